"""`megatron-recipes convert ...` end to end: the default logits check, its table and its exit codes."""

from __future__ import annotations

import pytest

from convert_support import assert_same_tensors, make_hf_model
from megatron_recipes.cli import main

pytestmark = pytest.mark.slow


def test_help_lists_every_family(capsys):
    assert main(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert arch in out


def test_import_verifies_small_models_and_verify_fails_on_other_weights(tmp_path, capsys):
    hf = make_hf_model("qwen3", tmp_path / "hf")
    out = tmp_path / "ckpt"
    assert main(["convert", "import", f"hf_dir={hf}", f"out_dir={out}", "parallel.tp=2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "HF vs checkpoint at tp=2 pp=1" in printed and " ok" in printed  # verified at the target layout
    assert "peak RSS" in printed and f"checkpoint.pretrained={out.resolve()}" in printed
    assert (out / "model" / "hf.yaml").is_file()
    import torch  # what Megatron-LM's load_checkpoint reads first: an HF import is where its fine-tuning starts

    from megatron_recipes.checkpoint import restricted_loading

    with restricted_loading():
        common = torch.load(out / "iter_0000000" / "common.pt", map_location="cpu")
    args = common["args"]
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0 and args.no_save_optim
    assert (args.num_layers, args.tensor_model_parallel_size, args.qk_layernorm) == (4, 2, True)

    exported = tmp_path / "exported"
    assert main(["convert", "export", f"ckpt_dir={out}", f"hf_dir={exported}", "--no-verify", "--quiet"]) == 0
    assert_same_tensors(hf, exported)

    other = make_hf_model("qwen3", tmp_path / "other", seed=1)  # same architecture, other weights
    code = main(["convert", "verify", f"hf_dir={other}", f"ckpt_dir={out}", "parallel.tp=1"])
    captured = capsys.readouterr()
    assert code == 2
    assert "FAIL" in captured.out and "logits differ by up to" in captured.err
    assert "same architecture but other weights" in captured.err and "please report" not in captured.err  # a user's mix-up


def test_export_overwrite_never_removes_its_own_source_or_an_hf_download(tmp_path, capsys):
    # Before: `convert export ckpt_dir=hfx/megatron hf_dir=hfx --overwrite` replaced hfx whole, the source
    # checkpoint inside it included; and any folder with a config.json (an HF download) counted as ours.
    hf = make_hf_model("llama", tmp_path / "download")
    hfx = tmp_path / "hfx"
    ckpt = hfx / "megatron"
    assert main(["convert", "import", f"hf_dir={hf}", f"out_dir={tmp_path / 'first'}", "--no-verify", "--quiet"]) == 0
    assert main(["convert", "export", f"ckpt_dir={tmp_path / 'first'}", f"hf_dir={hfx}", "--no-verify", "--quiet"]) == 0
    assert main(["convert", "import", f"hf_dir={hfx}", f"out_dir={ckpt}", "--no-verify", "--quiet"]) == 0
    download = sorted(p.name for p in hf.iterdir())
    capsys.readouterr()

    code = main(["convert", "export", f"ckpt_dir={ckpt}", f"hf_dir={hfx}", "--overwrite", "--no-verify", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "holds the input ckpt_dir" in err and "fix: choose a hf_dir outside ckpt_dir" in err, err
    assert (ckpt / "latest_checkpointed_iteration.txt").is_file() and (hfx / "config.json").is_file()

    code = main(["convert", "export", f"ckpt_dir={ckpt}", f"hf_dir={hf}", "--overwrite", "--no-verify", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "not a hf export output megatron-recipes wrote" in err, err
    assert sorted(p.name for p in hf.iterdir()) == download and "model.safetensors" in download

    again = tmp_path / "again"  # an export of ours is replaced by the next one
    assert main(["convert", "export", f"ckpt_dir={ckpt}", f"hf_dir={again}", "--no-verify", "--quiet"]) == 0
    assert main(["convert", "export", f"ckpt_dir={ckpt}", f"hf_dir={again}", "--overwrite", "--no-verify", "--quiet"]) == 0
    assert_same_tensors(hf, again)
