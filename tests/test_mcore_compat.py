"""The supported megatron-core range is defined once (runtime/mcore_compat.py) and everything agrees with it:
pyproject's pin, the refusal a run gives outside it, and the spec shapes of every supported release.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.runtime import mcore_compat

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_pins_the_supported_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("megatron-core")]
    assert pin.replace(" ", "") == mcore_compat.pip_requirement()


def test_the_installed_release_is_supported():
    mcore_compat.require_supported()  # raises outside the range


@pytest.mark.parametrize("release", ["0.15.2", "0.20.0", "0.20.0rc1", "1.0.0"])
def test_a_release_outside_the_range_is_refused_with_the_range_and_how_to_install(release):
    with pytest.raises(RecipeError) as err:
        mcore_compat.require_supported(release)
    text = err.value.render()
    assert release in text and "0.16" in text and "0.20" in text and f"pip install '{mcore_compat.pip_requirement()}'" in text


@pytest.mark.parametrize("release", ["0.16.1", "0.17.1", "0.18.2", "0.19.2"])
def test_the_tested_releases_are_in_range(release):
    mcore_compat.require_supported(release)


def test_a_command_refuses_an_unsupported_megatron_core(tmp_path):
    """The CLI stops before megatron-core is used: exit 2 and the fix, no traceback. The installed
    release's metadata is shadowed by a dist-info that says 0.99.0 (the code imported stays the same)."""
    info = tmp_path / "megatron_core-0.99.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.99.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "megatron_recipes.cli", "check", "tiny_llama_cpu"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "megatron-core 0.99.0 is installed" in res.stderr and "pip install" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_built_class_sees_through_partial_specs():
    """0.18 on, MoE layers are ``functools.partial(MoELayer, submodules=...)``, older ones ``ModuleSpec``s."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    assert mcore_compat.built_class(functools.partial(MoELayer, submodules=None)) is MoELayer
    assert mcore_compat.built_class(functools.partial(functools.partial(MoELayer), config=None)) is MoELayer
    assert mcore_compat.built_class(ModuleSpec(module=MoELayer)) is MoELayer
    assert mcore_compat.built_class(None) is None


def test_local_spec_replacement_reaches_inside_a_partial():
    """The local spec's module swaps (SDPA attention, SP norms) also apply to modules a partial spec builds."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_recipes.models.local_spec import _replace_modules

    class Replacement(DotProductAttention):
        pass

    inner = ModuleSpec(module=DotProductAttention)
    spec = ModuleSpec(module=object, submodules=[functools.partial(MoELayer, inner, submodules=inner)])
    out = _replace_modules(spec, {DotProductAttention: Replacement}).submodules[0]
    assert isinstance(out, functools.partial) and out.func is MoELayer
    assert out.args[0].module is Replacement and out.keywords["submodules"].module is Replacement



def _mtp_tracker_round_trip():
    """(one rank, CPU lane: the tracker allocates on the CUDA device) What take_mtp_losses reads and leaves."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as helper

    from megatron_recipes.runtime import cpu_lane

    if cpu_lane.needed():
        cpu_lane.activate()
    out = {"empty": mcore_compat.take_mtp_losses(2)}
    for layer, loss in ((0, 1.5), (1, 2.5), (0, 0.5)):
        if mcore_compat.at_least(mcore_compat.MTP_TRACKER_RENAMED_IN):
            helper.save_metrics_to_tracker(torch.tensor(loss), torch.tensor(0.0), torch.tensor(1.0), layer, 2)
        else:
            helper.save_loss_to_tracker(torch.tensor(loss), layer, 2)
    out["taken"] = mcore_compat.take_mtp_losses(2).tolist()
    out["after"] = mcore_compat.take_mtp_losses(2).tolist()
    try:
        mcore_compat.take_mtp_losses(1)
    except RuntimeError as exc:
        out["wrong_count"] = str(exc)
    return out


def test_mtp_losses_are_taken_from_the_tracker_and_cleared():
    """Each release's MTPLossLoggingHelper keeps the MTP losses under its own names (0.19: beside acceptance
    counts); the trainer reads and clears them through mcore_compat."""
    from multiproc import run_ranks

    out = run_ranks(_mtp_tracker_round_trip, 1)[0]
    assert out["empty"] is None
    assert out["taken"] == [2.0, 2.5] and out["after"] == [0.0, 0.0]
    assert "2 MTP losses" in out.get("wrong_count", "")
