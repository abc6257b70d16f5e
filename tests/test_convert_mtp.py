"""DeepSeek-V3's multi-token-prediction layer converts: megatron-core computes with it what DeepSeek-V3's MTP
formula computes on transformers' own modules.

transformers ignores ``model.layers.<num_hidden_layers>.*``, so the family tests' logits cannot see the MTP
layer (their bit-exact round trips, at TP=1 and TP=2 x PP=2 x EP=2 and resharded, do include it). Here the
tiny DeepSeek-V3 (4 layers, MTP layer 4 with MLA, YaRN and routed + shared experts) is imported at TP=1 and
run by megatron-core on one rank (float32, eval): the logits its MTP layer feeds to the output layer must
be those of ``mtp_support.reference_mtp_logits`` (transformers' decoder layer 4, loaded by transformers, and
the HF tensors enorm, hnorm, eh_proj, shared_head) within 1e-4 at every position, and its main logits
transformers' own. Both ways HF stores MLA's RoPE channels are run: interleaved (``rope_interleave: true``,
the default) and in halves (permuted on import, the MTP layer's attention as the decoder's). A copy of the
folder with eh_proj's two input halves swapped (embedding and hidden state exchanged) must not match: the
comparison sees the concatenation order. An MTP copy of the embedding that differs from the model's is
refused before anything is written.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from convert_support import make_hf_model
from mtp_support import reference_mtp_logits
from multiproc import run_ranks

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


def _megatron_logits(ckpt: str, tokens_path: str, out_path: str) -> int:
    """(one rank) The imported checkpoint in megatron-core with its MTP layer: the output layer's inputs come
    from the main model and from the MTP layer; each call's logits are kept. Returns the number of calls."""
    from pathlib import Path

    import torch

    from megatron_recipes import checkpoint
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.verify import checkpoint_config
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime.distributed import init_model_parallel, shutdown

    cfg = checkpoint_config(Path(ckpt), ParallelConfig(), 1, mtp=True)
    assert cfg.model.mtp_num_layers == 1
    init_model_parallel(cfg)
    try:
        (model,) = build_model_chunks(cfg)
        checkpoint.load_weights(Path(ckpt), [model], cfg)
        model.eval()
        tokens = torch.load(tokens_path)
        batch, seq = tokens.shape
        calls = []  # cloned: megatron-core's vocab-parallel cross entropy shifts the logits in place afterwards
        hook = model.output_layer.register_forward_hook(lambda module, args, output: calls.append(output[0].detach().clone()))
        with torch.no_grad():
            model(tokens, torch.arange(seq).expand(batch, seq), attention_mask=None,
                  labels=torch.roll(tokens, -1, dims=1), loss_mask=torch.ones(batch, seq))
        hook.remove()
        # [seq, batch, padded vocab] per call -> [batch, seq, vocab]
        torch.save([c.transpose(0, 1)[..., : cfg.model.vocab_size].float() for c in calls], out_path)
        return len(calls)
    finally:
        shutdown()


@pytest.fixture(scope="module", params=[True, False], ids=["rope_interleave", "rope_halves"])
def imported(tmp_path_factory, request):
    """The tiny DeepSeek-V3 imported: its RoPE channels stored interleaved (HF's default) or in halves
    (``rope_interleave: false``, permuted on import for the MTP layer's attention as for the decoder's)."""
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert import verify
    from megatron_recipes.convert.importer import run_import

    root = tmp_path_factory.mktemp("mtp")
    hf = make_hf_model("deepseek_v3", root / "hf", rope_interleave=request.param)
    ckpt = run_import(hf, root / "ckpt", ParallelConfig(), progress=False)
    assert ckpt.cfg.model.mtp_num_layers == 1
    tokens = verify.prompt_tokens(1000)
    torch.save(tokens, root / "tokens.pt")
    calls = run_ranks(_megatron_logits, 1, str(ckpt.out_dir), str(root / "tokens.pt"), str(root / "logits.pt"))[0]
    assert calls == 2, f"the output layer ran {calls} times (expected the MTP layer's, then the main model's)"
    mtp, main = torch.load(root / "logits.pt")
    return hf, tokens, mtp, main


def test_main_logits_of_the_mtp_model_match_hf(imported):
    from megatron_recipes.convert import verify

    hf, tokens, _, main = imported
    diff = (main - verify.hf_logits(hf, tokens)).abs().max().item()
    assert diff <= TOLERANCE, f"main logits differ by up to {diff:.3e}"


def test_mtp_layer_matches_deepseek_formula_on_hf_modules(imported):
    hf, tokens, mtp, main = imported
    reference = reference_mtp_logits(hf, tokens)
    assert mtp.shape == reference.shape, (mtp.shape, reference.shape)
    diff = (mtp - reference).abs().max().item()
    assert diff <= TOLERANCE, f"MTP logits differ by up to {diff:.3e}"
    assert (mtp - main).abs().max().item() > 100 * TOLERANCE, "the MTP logits are the main model's: nothing was compared"


def test_swapped_concatenation_is_seen(imported, tmp_path):
    hf, tokens, mtp, _ = imported
    from safetensors.torch import load_file, save_file

    swapped = tmp_path / "swapped"
    shutil.copytree(hf, swapped)
    (path,) = sorted(swapped.glob("*.safetensors"))
    tensors = load_file(str(path))
    name = "model.layers.4.eh_proj.weight"
    h = tensors[name].shape[0]
    tensors[name] = torch.cat([tensors[name][:, h:], tensors[name][:, :h]], dim=1).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    diff = (mtp - reference_mtp_logits(swapped, tokens)).abs().max().item()
    assert diff > 100 * TOLERANCE, f"embedding and hidden state exchanged, yet the MTP logits agree ({diff:.3e})"


def test_a_separate_mtp_embedding_is_refused_before_writing(imported, tmp_path):
    """megatron-core's MTP layers share the model's embedding: an MTP copy that differs has no place to go."""
    from safetensors.torch import load_file, save_file

    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.importer import run_import

    hf = imported[0]
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    (path,) = sorted(other.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["model.layers.4.embed_tokens.weight"][7, 3] += 1.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(RecipeError) as err:
        run_import(other, tmp_path / "out", ParallelConfig(), progress=False)
    assert "model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight (first at row 7)" in err.value.render()
    assert not (tmp_path / "out").exists()


def test_a_folder_without_the_mtp_copies_imports_and_exports_them(imported, tmp_path):
    """Megatron-Bridge's DeepSeek-V3 export leaves out the MTP layer's copies of the embedding and head (megatron-core
    shares the model's): such a folder imports as the full one does, and the export writes the copies back."""
    from safetensors.torch import load_file, save_file

    from convert_support import assert_same_tensors
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.exporter import run_export
    from megatron_recipes.convert.importer import run_import

    hf = imported[0]
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    (path,) = sorted(bare.glob("*.safetensors"))
    tensors = load_file(str(path))
    for name in ("model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"):
        del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    for index in bare.glob("*.index.json"):
        index.unlink()
    run_import(bare, tmp_path / "ckpt", ParallelConfig(), progress=False)
    run_export(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    assert_same_tensors(hf, tmp_path / "hf")
