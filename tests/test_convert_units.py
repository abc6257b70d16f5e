"""The conversion engine's building blocks, checked against layouts written out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ModelConfig, ParallelConfig
from megatron_recipes.convert.layout import min_world_size
from megatron_recipes.convert.safetensors_io import SafetensorsReader, ShardedSafetensorsWriter
from megatron_recipes.families.transforms import QKV, Ctx, Gated, RopeRows, Vocab


class DictSource:
    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors

    def read_rows(self, name, out, start=0):
        out.copy_(self.tensors[name].reshape(-1, *out.shape[1:])[start : start + out.shape[0]])


def _model(**kw) -> ModelConfig:
    base = dict(name="t", family="llama", num_layers=1, hidden_size=4, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=6, vocab_size=5, max_position_embeddings=8, kv_channels=1)
    base.update(kw)
    return ModelConfig(**base)


def _rows(*labels):
    return torch.tensor([[float(x)] * 3 for x in labels])


def test_qkv_is_fused_per_query_group():
    # 4 heads in 2 groups, head dim 1: q rows 10..13, k rows 20..21, v rows 30..31
    src = DictSource({"q": _rows(10, 11, 12, 13), "k": _rows(20, 21), "v": _rows(30, 31)})
    ctx = Ctx(_model())
    t = QKV("q", "k", "v")
    assert t.hf_shapes((8, 3), ctx) == {"q": (4, 3), "k": (2, 3), "v": (2, 3)}
    out = torch.empty(8, 3)
    t.fill(out, src, ctx)
    assert out[:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]  # [q_1, q_2, k, v] per group
    back = {name: torch.cat(pieces) for name, pieces in t.pieces(out, ctx).items()}
    assert all(torch.equal(back[n], src.tensors[n]) for n in "qkv")


def test_qkv_bias_uses_the_same_grouping():
    src = DictSource({"q": torch.tensor([10.0, 11, 12, 13]), "k": torch.tensor([20.0, 21]), "v": torch.tensor([30.0, 31])})
    out = torch.empty(8)
    QKV("q", "k", "v").fill(out, src, Ctx(_model()))
    assert out.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_gated_mlp_and_vocab_padding():
    src = DictSource({"g": _rows(1, 2), "u": _rows(3, 4), "emb": _rows(5, 6, 7, 8, 9)})
    ctx = Ctx(_model())
    fc1 = torch.empty(4, 3)
    Gated("g", "u").fill(fc1, src, ctx)
    assert fc1[:, 0].tolist() == [1, 2, 3, 4]
    emb = torch.full((8, 3), 99.0)
    Vocab("emb").fill(emb, src, ctx)
    assert emb[:, 0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert torch.equal(Vocab("emb").pieces(emb, ctx)["emb"][0], src.tensors["emb"])


def test_rope_rows_interleave_only_when_hf_stores_halves():
    m = _model(qk_head_dim=2, qk_pos_emb_head_dim=4)
    rows = _rows(0, 1, 2, 3, 4, 5)  # one head: 2 plain rows, then rope rows in halves order x0 x1 y0 y1
    t = RopeRows("w", lambda m: m.qk_head_dim + m.qk_pos_emb_head_dim, lambda m: m.qk_pos_emb_head_dim)
    out = torch.empty(6, 3)
    t.fill(out, DictSource({"w": rows}), Ctx(m, extra={"rope_interleave": False}))
    assert out[:, 0].tolist() == [0, 1, 2, 4, 3, 5]  # megatron's MLA wants x0 y0 x1 y1
    assert torch.equal(t.pieces(out, Ctx(m, extra={"rope_interleave": False}))["w"][0], rows)
    t.fill(out, DictSource({"w": rows}), Ctx(m, extra={"rope_interleave": True}))
    assert torch.equal(out, rows)


def test_streaming_safetensors_round_trip(tmp_path: Path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(5, 7), "b": torch.randn(300).to(torch.bfloat16), "c": torch.randn(2, 3, 4)}
    entries = [(n, t.dtype, t.shape) for n, t in tensors.items()]
    writer = ShardedSafetensorsWriter(tmp_path, entries, max_shard_bytes=150)  # forces several shards
    writer.write_rows("b", tensors["b"])
    writer.write_rows("a", tensors["a"][3:], start_row=3)  # pieces, in any order
    writer.write_rows("a", tensors["a"][:3])
    writer.write_rows("c", tensors["c"].double())  # converted to the declared dtype
    weight_map = writer.finish()
    assert len(set(weight_map.values())) == 3
    loaded = {}
    for f in set(weight_map.values()):
        loaded.update(load_file(str(tmp_path / f)))  # the reference reader accepts our files
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict(sorted(weight_map.items()))

    reader = SafetensorsReader(tmp_path)
    part = torch.empty(2, 7, dtype=torch.float64)
    reader.read_rows("a", part, start=1)
    assert torch.equal(part, tensors["a"][1:3].double())


def test_incomplete_writes_are_refused(tmp_path: Path):
    writer = ShardedSafetensorsWriter(tmp_path, [("a", torch.float32, (4,))], max_shard_bytes=1 << 20)
    writer.write_rows("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="incompletely"):
        writer.finish()
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_reader_rejects_non_finite_values(tmp_path: Path):
    save_file({"w": torch.tensor([1.0, float("inf")])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RecipeError, match="tensor w .* NaN or Inf"):
        SafetensorsReader(tmp_path).read("w")


@pytest.mark.parametrize(
    "parallel, world",
    [(ParallelConfig(), 1), (ParallelConfig(tp=2, pp=2), 4), (ParallelConfig(tp=2, pp=2, ep=2, etp=1), 4),
     (ParallelConfig(tp=1, ep=4), 4), (ParallelConfig(tp=2, ep=4, etp=1), 4), (ParallelConfig(tp=2, ep=2), 4)],
)
def test_min_world_size(parallel, world):
    assert min_world_size(parallel) == world


def test_checkpoint_reader_whole_chunks_and_regions(tmp_path: Path):
    """An item stored as one chunk is handed over as loaded; a region of a bigger chunk goes through DCP."""
    from megatron_recipes.convert.dcp_io import CheckpointReader, write_items
    from megatron_recipes.convert.target import Item

    torch.manual_seed(0)
    full = torch.randn(2, 4, 3)  # two layers stacked on a leading axis

    def item(key, layer):
        prepend = 0 if layer is None else 1
        return Item(key, key, (2, 4, 3), (layer or 0, 0, 0), prepend, torch.float32, layer, None)

    per_layer = [item("stacked", 0), item("stacked", 1)]
    whole = item("whole", None)
    write_items(tmp_path, per_layer + [whole], lambda it: full[it.layer].clone() if it.prepend else full.clone())
    reader = CheckpointReader(tmp_path)

    assert reader._whole_chunk(whole) is not None and reader._whole_chunk(per_layer[1]) is not None
    assert torch.equal(reader.read(whole), full)
    assert torch.equal(reader.read(per_layer[1]), full[1])
    assert reader.read(whole, torch.bfloat16).dtype == torch.bfloat16
    region = item("whole", 1)  # layer 1 of a tensor stored as one chunk
    assert reader._whole_chunk(region) is None
    assert torch.equal(reader.read(region), full[1])


def test_printed_train_command_is_shell_safe(tmp_path):
    """[ ] are globs to zsh and a path may hold spaces: the command import prints must survive a shell."""
    import shlex

    from megatron_recipes.convert.importer import train_command

    out = tmp_path / "with space" / "out"
    words = shlex.split(train_command(out, "tiny"))
    root = out.resolve()
    assert words[3:] == [f"hydra.searchpath=[file://{root}]", "model=tiny", f"checkpoint.pretrained={root}"]


def test_logits_of_other_weights_are_told_apart_from_a_conversion_off_by_rounding():
    from megatron_recipes.convert.verify import Metrics

    assert not Metrics(3e-3, 2e-4, 0.99999, 1.0).looks_unrelated()  # a conversion bug or bf16 rounding: report it
    assert not Metrics(0.5, 0.05, 0.97, 0.93).looks_unrelated()  # a wrong split still mostly agrees
    assert Metrics(4.2, 0.9, 0.31, 0.02).looks_unrelated()  # another model
    assert not Metrics(float("nan"), float("nan"), float("nan"), 0.0).looks_unrelated()  # NaNs are a bug
