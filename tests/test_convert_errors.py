"""Bad input to `convert import/export`: a clear RecipeError naming the tensor or field, and nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert_support import make_hf_model
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ParallelConfig
from megatron_recipes.convert.exporter import run_export
from megatron_recipes.convert.importer import run_import

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return make_hf_model("mixtral", tmp_path_factory.mktemp("hf") / "mixtral")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def _nothing_left(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], list(parent.iterdir())


def _import(hf: Path, out: Path, **kw):
    return run_import(hf, out, kw.pop("parallel", ParallelConfig()), progress=False, **kw)


def test_unknown_architecture(llama, tmp_path):
    hf = _copy(llama, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError, match="FancyNetForCausalLM") as info:
        _import(hf, tmp_path / "out")
    assert "LlamaForCausalLM" in info.value.fix
    _nothing_left(tmp_path, "out")


def test_missing_extra_and_misshaped_tensors_are_all_named(llama, tmp_path):
    hf = _copy(llama, tmp_path / "hf")

    def edit(t):
        del t["model.layers.2.mlp.up_proj.weight"]
        t["model.layers.1.mlp.surprise.weight"] = torch.zeros(3)
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)

    _edit_weights(hf, edit)
    with pytest.raises(RecipeError) as info:
        _import(hf, tmp_path / "out")
    text = info.value.render()
    assert "missing tensor model.layers.2.mlp.up_proj.weight" in text
    assert "model.layers.1.mlp.surprise.weight" in text
    assert "model.layers.0.self_attn.k_proj.weight has shape [48, 64], config.json implies [32, 64]" in text
    _nothing_left(tmp_path, "out")


def test_nan_in_weights_stops_and_leaves_no_output(llama, tmp_path):
    hf = _copy(llama, tmp_path / "hf")
    bad = "model.layers.3.mlp.down_proj.weight"  # late in the write order: earlier tensors are already written

    def edit(t):
        t[bad][1, 2] = float("nan")

    _edit_weights(hf, edit)
    with pytest.raises(RecipeError, match=bad.replace(".", r"\.") + ".*NaN or Inf"):
        _import(hf, tmp_path / "out")
    _nothing_left(tmp_path, "out")


@pytest.mark.parametrize(
    "parallel, words",
    [
        (ParallelConfig(tp=3), ["num_attention_heads=4", "parallel.tp=3"]),
        (ParallelConfig(tp=4), ["num_query_groups=2", "parallel.tp in {1, 2}"]),  # the rule table's notation
        (ParallelConfig(pp=3), ["num_layers=4", "parallel.pp*vpp = 3*1 = 3"]),
        (ParallelConfig(ep=2), ["parallel.ep=2", "dense"]),
    ],
)
def test_unusable_layout(llama, tmp_path, parallel, words):
    with pytest.raises(RecipeError) as info:
        _import(llama, tmp_path / "out", parallel=parallel)
    for word in words:
        assert word in info.value.render()
    _nothing_left(tmp_path, "out")


def test_experts_must_divide_ep(mixtral, tmp_path):
    with pytest.raises(RecipeError, match="num_moe_experts=4 is not divisible by parallel.ep=3"):
        _import(mixtral, tmp_path / "out", parallel=ParallelConfig(ep=3))


def test_existing_outputs_need_overwrite(llama, tmp_path):
    out = tmp_path / "out"
    _import(llama, out)
    with pytest.raises(RecipeError, match="already exists"):
        _import(llama, out)
    _import(llama, out, overwrite=True)  # replacing a previous conversion is fine
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="not a megatron import output megatron-recipes wrote"):
        _import(llama, precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me"

    exported = tmp_path / "exported"
    run_export(out, exported, progress=False)
    with pytest.raises(RecipeError, match="already exists"):
        run_export(out, exported, progress=False)


def test_missing_parents_of_the_output_are_created_and_a_file_in_the_way_is_named(llama, tmp_path):
    deep = tmp_path / "new" / "deeper" / "out"
    _import(llama, deep)  # as mkdir -p would
    assert (deep / "iter_0000000").is_dir() and not any(p.name.startswith(".") for p in (tmp_path / "new" / "deeper").iterdir())
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(RecipeError, match="is not a folder"):
        _import(llama, tmp_path / "a-file" / "out")
    with pytest.raises(RecipeError, match="is not a folder"):
        run_export(deep, tmp_path / "a-file" / "sub" / "hf", progress=False)


def test_export_refuses_a_checkpoint_of_another_model(llama, tmp_path):
    ours = _import(llama, tmp_path / "ours").checkpoint
    other_hf = _copy(llama, tmp_path / "other_hf")
    config = json.loads((other_hf / "config.json").read_text())
    config["intermediate_size"] = 80
    (other_hf / "config.json").write_text(json.dumps(config))

    def shrink(t):
        for k in list(t):
            if "down_proj" in k:
                t[k] = t[k][:, :80].contiguous()
            elif "gate_proj" in k or "up_proj" in k:
                t[k] = t[k][:80].contiguous()

    _edit_weights(other_hf, shrink)
    other = _import(other_hf, tmp_path / "other").checkpoint

    # a config.yaml that does not match the checkpoint's own fingerprint
    shutil.copy(other / "config.yaml", ours / "config.yaml")
    with pytest.raises(RecipeError, match="ffn_hidden_size"):
        run_export(ours, tmp_path / "hf_out", progress=False)
    # matching description files, but the tensors of another model: the checksum record (another model's
    # files) names the mismatch; without a record (a checkpoint saved before them) the shape check does
    shutil.copy(other / "meta.json", ours / "meta.json")
    with pytest.raises(RecipeError, match=r"is damaged: .* differ from what was saved"):
        run_export(ours, tmp_path / "hf_out", progress=False)
    meta = json.loads((ours / "meta.json").read_text())
    del meta["files"]
    (ours / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match=r"decoder\.layers\.mlp\.linear_fc1\.weight: checkpoint shape \(4, 192, 64\)"):
        run_export(ours, tmp_path / "hf_out", progress=False)
    _nothing_left(tmp_path, "hf_out")


def test_cli_reports_errors_without_traceback(llama, tmp_path, capsys):
    from megatron_recipes.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    code = main(["convert", "import", f"hf_dir={llama}", f"out_dir={out}", "--no-verify", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert main(["convert", "import", f"hf_dir={llama}", "--quiet"]) == 2
    assert "missing required option 'out_dir='" in capsys.readouterr().err
