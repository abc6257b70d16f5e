"""The patch table (runtime/patches/): every row still needed by the installed megatron-core/torch, every
row fixing what it claims once applied, each row naming an existing test, and nothing patched on import.

Each check runs in a fresh interpreter: patches are process-wide, and "needed" must look at the
unpatched library.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_recipes.runtime import patches

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-lane rows apply only without CUDA")


def _run(code: str) -> dict:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_row_names_a_test_that_exists_and_a_known_scope():
    assert len({p.name for p in patches.PATCHES}) == len(patches.PATCHES)
    for p in patches.PATCHES:
        assert p.scope in patches.SCOPES and p.target and p.reason and p.versions[0], p.name
        path, _, name = p.test.partition("::")
        assert (ROOT / path).is_file(), p.test
        assert not name or f"def {name}(" in (ROOT / path).read_text(), p.test


def test_every_row_is_needed_exactly_inside_its_range():
    """On the unpatched installed megatron-core every row's probe runs, in range or not: a defect outside
    the row's range (the range is wrong, and the row is not applied), or none inside it (fixed upstream:
    end the range at this release), fails."""
    found = _run("import json; from megatron_recipes.runtime import patches\n"
                 "print(json.dumps(patches.defects_in_and_out_of_range()))")
    wrong = {name: row for name, row in found.items() if row["in_range"] != row["defect"]}
    assert found and not wrong, {"installed megatron-core": patches.mcore_compat.installed(), **wrong}
    always_here = {p.name for p in patches.PATCHES if p.requires is None}  # this CPU machine: every no-CUDA row
    assert always_here <= set(found)


def test_ranges_are_well_formed_and_outside_rows_are_not_applied():
    for p in patches.PATCHES:
        low, high = p.versions
        assert patches.mcore_compat.version_tuple(low) >= patches.mcore_compat.version_tuple(patches.mcore_compat.SUPPORTED[0])
        assert high is None or patches.mcore_compat.version_tuple(high) > patches.mcore_compat.version_tuple(low), p.name
    for p in patches.PATCHES:  # apply() applies exactly rows(scope)
        assert (p in patches.rows(p.scope)) == (patches.in_range(p) and patches.can_occur_here(p)), p.name


def test_every_module_patch_fixes_its_defect():
    code = (
        "import json; from megatron_recipes.runtime import patches\n"
        "for scope in patches.SCOPES:\n    if scope not in ('save', 'async_save'): patches.apply(scope)\n"
        "found = {}\n"
        "for scope in ('save', 'async_save'):  # both fill the writer's queue slot: one at a time\n"
        "    with patches.applied(scope): found.update({p.name: v for p, v in ((p, p.defect()) for p in patches.rows(scope))})\n"
        "found.update({k: v for k, v in patches.defects().items() if k not in found})\n"
        "print(json.dumps(found))"
    )
    found = _run(code)
    module_rows = {p.name for p in patches.PATCHES if not p.on_object and patches.applies_here(p)}
    assert module_rows and not any(found[name] for name in module_rows), {k: v for k, v in found.items() if v}


def test_importing_the_package_patches_nothing():
    code = (
        "import json, torch; original = torch.compile\n"
        "import megatron_recipes, megatron_recipes.cli, megatron_recipes.train, megatron_recipes.runtime.patches\n"
        "from megatron.core.optimizer import clip_grads\n"
        "print(json.dumps({'compile': torch.compile is original,\n"
        "                  'norm': not getattr(clip_grads.l2_norm_impl, '_megatron_recipes', False)}))"
    )
    assert _run(code) == {"compile": True, "norm": True}


def test_wandb_is_imported_on_first_use():
    """After the process patches, importing megatron-core leaves wandb unloaded (it costs seconds per
    process); the first read of one of its attributes, by megatron-core or by our tracker, imports the real
    module, which then also stands in sys.modules."""
    pytest.importorskip("wandb")
    code = (
        "import json, sys; from megatron_recipes.runtime import patches; patches.apply('process')\n"
        "import megatron.core.timers as timers, megatron.core.models.gpt\n"
        "from megatron_recipes.training import tracking\n"
        "before = 'wandb.sdk' in sys.modules; installed = tracking._installed('wandb')\n"
        "import wandb; init = wandb.init\n"
        "real = sys.modules['wandb']\n"
        "print(json.dumps({'before': before, 'installed': installed, 'after': 'wandb.sdk' in sys.modules,\n"
        "    'real': type(real).__name__ == 'module' and real.init is init and timers.wandb.Image is real.Image}))"
    )
    assert _run(code) == {"before": False, "installed": True, "after": True, "real": True}


def test_grad_norm_is_the_same_for_every_sharding():
    """The gradient norm of one set of gradients, whole (one rank) and split in two (TP=2: each rank's norm
    squared, summed, as megatron-core's get_grad_norm_fp32 all-reduces it), through megatron-core's own
    clip_grads.l2_norm_impl: unpatched they part by more than check allows; patched they agree."""
    code = (
        "import json, torch\n"
        "from megatron_recipes.runtime import patches\n"
        "from megatron_recipes.runtime.cpu_lane import cuda_calls_on_cpu\n"
        "from megatron.core.optimizer import clip_grads\n"
        "g = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.01 for n in (524288, 49152, 128)]\n"
        "def norm(ts):\n"
        "    with cuda_calls_on_cpu(): return clip_grads.l2_norm_impl(65536, None, [ts], False)[0].double()\n"
        "def apart():\n"
        "    whole = norm(g)\n"
        "    split = (norm([t[: t.numel() // 2] for t in g]) ** 2 + norm([t[t.numel() // 2:] for t in g]) ** 2).sqrt()\n"
        "    return abs(whole - split).item() / whole.item()\n"
        "before = apart(); patches.apply('cpu_lane'); after = apart()\n"
        "print(json.dumps({'before': before, 'after': after}))"
    )
    found = _run(code)
    assert found["before"] > 1e-6, found  # the defect the row fixes (drop the row when this fails)
    assert found["after"] < 3e-7, found  # float32 results: a few ulps


def test_the_fallbacks_without_transformer_engine_are_patched_on_gpus_too():
    """megatron-core's MoE router GEMM and Megatron-FSDP's TELinear check break wherever TE does not import,
    a GPU image without TE included: those rows must not be limited to the CPU lane, and the model builder
    (which every GPU run goes through) applies their scope."""
    import inspect

    from megatron_recipes.models import builder

    rows = {p.name: p for p in patches.PATCHES}
    for name in ("moe-te-general-gemm", "fsdp-telinear"):
        assert rows[name].scope == "no_te" and not rows[name].without_cuda, name
    assert 'patches.apply("no_te")' in inspect.getsource(builder.build_gpt_model)


def test_the_moe_aux_loss_row_applies_on_gpus_too():
    """The aux-loss token count is wrong on every device (GPU runs are what users train): the row must not be
    limited to the CPU lane or to missing TE, and the model builder applies its scope for every model."""
    import inspect

    from megatron_recipes.models import builder

    row = {p.name: p for p in patches.PATCHES}["moe-aux-loss-token-count"]
    assert row.scope == "model" and not row.without_cuda and row.requires is None
    source = inspect.getsource(builder.build_gpt_model)
    assert 'patches.apply("model")' in source and source.index('patches.apply("model")') < source.index("GPTModel(")
