"""`convert export` of a Megatron-FSDP run's checkpoint (fsdp_dtensor): one clear refusal, exit 2, nothing written.

The checkpoint is a real one: two gloo ranks train one step under Megatron-FSDP zero3 and save it, as
tests/test_checkpoint_fsdp.py does. Export reads torch_dist checkpoints only; the refusal names the format
and a way to a torch_dist checkpoint of those weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
FSDP = ["parallel.fsdp=true", "parallel.sharding=zero3"]


def _fsdp_checkpoint(run_dir: str) -> str:
    from megatron_recipes.checkpoint import save

    t = cs.Trainer(cs.tiny_cfg(run_dir, world=2, extra=FSDP))
    t.train(1, 1)
    state = {"step": 1, "consumed_samples": cs.GBS}
    return str(save(Path(run_dir) / "checkpoints", 1, t.model, t.optimizer, t.scheduler, state, t.cfg, keep_last=1))


def test_export_of_an_fsdp_checkpoint_is_refused_clearly(tmp_path, capsys):
    from megatron_recipes.cli import main
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.convert.exporter import run_export

    ckpt = Path(run_ranks(_fsdp_checkpoint, 2, str(tmp_path / "run"), timeout=900)[0])
    assert (ckpt / "meta.json").is_file()
    out = tmp_path / "hf"
    with pytest.raises(RecipeError) as refused:
        run_export(ckpt, out, progress=False)
    text = f"{refused.value.message}\n{refused.value.fix}"
    assert "saved under Megatron-FSDP (format fsdp_dtensor)" in text, text
    assert "export reads torch_dist checkpoints only" in text, text
    assert f"parallel.fsdp=false checkpoint.pretrained={ckpt}" in text, text
    assert not out.exists()

    assert main(["convert", "export", f"ckpt_dir={ckpt}", f"hf_dir={out}", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "fsdp_dtensor" in err and "parallel.fsdp=false" in err and "Traceback" not in err, err
    assert not out.exists()
