"""The megatron-core releases this project supports, and every difference between them it must know about.

Why one module: 0.16.1 to 0.19.2 renamed private helpers, moved the common checkpoint state into the
``.distcp`` files and started building layers from ``functools.partial`` specs. Each such difference is
named here once, with the release that introduced it, so callers ask a question ("does this release
write common.pt?") instead of guessing with ``try/except AttributeError`` (read from each release's
source: 0.16.1, 0.17.1, 0.18.2, 0.19.2). The patch table (``patches/``) records its own ranges.
"""

from __future__ import annotations

import functools
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Dict, Optional, Tuple

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RECOMPUTE_MODULES

# Supported: [first, first unsupported). pyproject.toml's pin must say the same (tests/test_mcore_compat.py).
SUPPORTED = ("0.16", "0.20")
NEWEST_TESTED = "0.19.2"  # the gpu extra and the Dockerfile install exactly this one
# megatron-core 0.17 and later declare Requires-Python >= 3.12: on Python 3.11 pip finds 0.16.x only.

COMMON_STATE_FILE = "common.pt"
COMMON_STATE_IN_DISTCP_SINCE = "0.19"  # save() stores the common state as a ShardedObject, no common.pt


def version_tuple(text: str) -> Tuple[int, ...]:
    """``"0.19.2"`` -> ``(0, 19, 2)``; a pre-release or local suffix (``rc1``, ``+cu13``) is ignored."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", text).group(0))[:3])


def installed() -> str:
    """The installed megatron-core's version, or ``"absent"``."""
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "absent"


def at_least(first: str, release: Optional[str] = None) -> bool:
    return version_tuple(release or installed()) >= version_tuple(first)


def in_range(low: str, high: Optional[str], release: Optional[str] = None) -> bool:
    """``low <= release < high`` (``high`` None: no upper end)."""
    now = version_tuple(release or installed())
    return now >= version_tuple(low) and (high is None or now < version_tuple(high))


def pip_requirement() -> str:
    return f"megatron-core>={SUPPORTED[0]},<{SUPPORTED[1]}"


def require_supported(release: Optional[str] = None) -> None:
    """Refuse a megatron-core outside ``SUPPORTED``: its behaviour is unknown, and a failure deep inside it
    would read like a bug of the recipe."""
    found = release or installed()
    if found == "absent":
        raise RecipeError(
            "megatron-core is not installed",
            fix=f"pip install '{pip_requirement()}' (or pip install 'megatron-recipes[gpu]' for megatron-core {NEWEST_TESTED} with Transformer Engine)",
        )
    if not in_range(*SUPPORTED, release=found):
        raise RecipeError(
            f"megatron-core {found} is installed; megatron-recipes supports megatron-core {SUPPORTED[0]} up to "
            f"(not including) {SUPPORTED[1]}",
            fix=f"pip install '{pip_requirement()}' (newest tested: megatron-core=={NEWEST_TESTED}, which needs "
            "Python 3.12; on Python 3.11 pip picks 0.16.x)",
        )


# --- checkpoints ---


def writes_common_pt(release: Optional[str] = None) -> bool:
    """Whether ``dist_checkpointing.save`` of this release writes ``common.pt`` (0.16-0.18) or keeps the
    common state inside the ``.distcp`` files (0.19 on)."""
    return not at_least(COMMON_STATE_IN_DISTCP_SINCE, release)


def reads_common_state_from_distcp(release: Optional[str] = None) -> bool:
    """0.19's ``load_common_state_dict`` reads both layouts; older releases read ``common.pt`` only."""
    return at_least(COMMON_STATE_IN_DISTCP_SINCE, release)


def write_results_queue_getter() -> Callable[[], Any]:
    """The checkpoint writer's results-queue factory: ``_get_write_results_queue`` until 0.16,
    ``get_write_results_queue(mp_mode='spawn')`` from 0.17."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    name = "get_write_results_queue" if at_least("0.17") else "_get_write_results_queue"
    return getattr(filesystem_async, name)


def async_save_options(release: Optional[str] = None) -> Dict[str, Any]:
    """Extra ``dist_checkpointing.save`` arguments of an async save: from 0.17 it takes ``async_strategy``,
    whose default ``"nvrx"`` needs nvidia-resiliency-ext; ``"mcore"`` is megatron-core's own writer, the one
    0.16 always used, whose ``AsyncCallsQueue`` (``strategies.async_utils``) the trainer drives."""
    return {"async_strategy": "mcore"} if at_least("0.17", release) else {}


# --- layer specs ---


def built_class(node: Any) -> Optional[type]:
    """The class a layer-spec entry builds: a class itself, a ``ModuleSpec``'s module, or the function a
    ``functools.partial`` wraps (0.18 on, MoE layers and shared experts), looked through recursively."""
    while True:
        if isinstance(node, type):
            return node
        if isinstance(node, functools.partial):
            node = node.func
            continue
        module = getattr(node, "module", None)
        if module is None or module is node:
            return None
        node = module


# --- multi-token prediction ---

MTP_TRACKER_RENAMED_IN = "0.19"  # 0.19's MTPLossLoggingHelper tracks acceptance counts too, under new names
# Not a call difference, a training one: with calculate_per_token_loss (always on here), 0.16 adds each MTP
# layer's summed loss to the gradients unscaled, so finalize_model_grads divides it by the main loss's token
# count; from 0.17 it is first scaled by (main tokens / MTP tokens) per micro-batch (MTP layer k has k fewer
# targets per sequence), i.e. normalised by its own count. Same runs, MTP gradients (S-k)/S as large on 0.16.
MTP_GRADIENT_PER_OWN_TOKENS_SINCE = "0.17"


def take_mtp_losses(num_layers: int, release: Optional[str] = None) -> Optional[Any]:
    """This rank's MTP losses since the last call (one per MTP layer: the sum over micro-batches of each
    micro-batch's mean), read from megatron-core's ``MTPLossLoggingHelper.tracker`` and cleared there; None
    where no forward pass recorded any (ranks before the loss's pipeline stage).

    GPTModel records them in its training forward on the stage that computes the loss, whichever stage holds
    the MTP layers. The tracker keeps them under ``values`` until 0.18 and ``loss_values`` from 0.19 (beside
    acceptance counts), cleared by ``clean_loss_in_tracker`` / ``clean_metrics_in_tracker``. Its own
    reduction (``reduce_loss_in_tracker``) averages with ``ReduceOp.AVG``, which gloo lacks: the trainer
    reduces the values itself (training/step.py)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    renamed = at_least(MTP_TRACKER_RENAMED_IN, release)
    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values" if renamed else "values")
    if values is None:
        return None
    if values.numel() != num_layers:
        raise RuntimeError(f"megatron-core tracked {values.numel()} MTP losses, the model has {num_layers} MTP layers")
    taken = values.detach().clone()
    (MTPLossLoggingHelper.clean_metrics_in_tracker if renamed else MTPLossLoggingHelper.clean_loss_in_tracker)()
    return taken


# --- EP communication overlap (overlap_moe_expert_parallel_comm: the combined 1F1B schedule) ---
# What each release's TransformerConfig.__post_init__ and combined_1f1b.py do differently with it (the rule table,
# validation/rules_ep_overlap.py, refuses what 0.16 refuses and names the release that lifts it):
# - an MTP layer needs pipeline parallelism in 0.16-0.17; 0.18 drops the condition (0.19 also accepts 0 layers);
# - Megatron-FSDP: 0.16-0.17's schedule calls the model's layers past MegatronFSDP.forward; 0.18 wires its hooks
#   (not with virtual stages);
# - 0.16 refuses delay_wgrad_compute with moe_use_legacy_grouped_gemm (0.17 removed that implementation); 0.17
#   refuses "moe" in recompute_modules (so does rule recompute.moe_with_ep_overlap, on every release: below);
# - 0.16-0.17 skip the interleaved schedule's backward post-processing of model chunk 0 (``if b_model_chunk_id:``,
#   fixed in 0.18): that chunk's overlapped gradient reduction then starts after the schedule, with the other
#   leftover reductions; the gradients are the same;
# - 0.18 builds the communication stream lazily and may give it a high priority (high_priority_a2a_comm_stream,
#   not set here); 0.16-0.17 mark every schedule step with torch.cuda.nvtx (the CPU lane stands it in).
EP_OVERLAP_MTP_WITHOUT_PIPELINE_SINCE = "0.18"
EP_OVERLAP_WITH_MEGATRON_FSDP_SINCE = "0.18"


def ep_overlap_mtp_needs_pipeline(release: Optional[str] = None) -> bool:
    """Whether this release refuses the EP overlap with an MTP layer and pipeline_model_parallel_size 1."""
    return not at_least(EP_OVERLAP_MTP_WITHOUT_PIPELINE_SINCE, release)


# --- selective recompute (recompute_granularity="selective" with recompute_modules) ---
# TransformerConfig.__post_init__ accepts core_attn, moe_act, layernorm, mla_up_proj, mlp, moe and shared_experts
# in 0.16.1-0.18.2; 0.19 adds gdn_norm_out (GatedDeltaNet's output norm, which no family here builds, so
# schema.RECOMPUTE_MODULES leaves it out). Differences in what a module does:
# - "moe" with overlap_moe_expert_parallel_comm: refused from 0.17; 0.16 accepts it, but its combined 1F1B schedule
#   calls the MoE layer's parts (fine_grained_callables.py) past MoELayer.forward, where the checkpoint is, so
#   nothing is recomputed: rule recompute.moe_with_ep_overlap refuses it on every release.
# - every release's CheckpointWithoutOutput() (layernorm and moe_act's output-discarding checkpoint) takes TE's
#   FP8 path by default (its fp8=False "is not None") and names TE's FP8GlobalStateManager: a NameError without
#   Transformer Engine (patch row checkpoint-without-output-no-te); mla_up_proj passes fp8=None and runs.
RECOMPUTE_MODULES_ADDED = {"gdn_norm_out": "0.19"}  # module -> the first release that accepts it
MOE_RECOMPUTE_REFUSED_WITH_EP_OVERLAP_SINCE = "0.17"


def recompute_modules(release: Optional[str] = None) -> Tuple[str, ...]:
    """The recompute_modules this release's TransformerConfig accepts."""
    added = tuple(name for name, since in RECOMPUTE_MODULES_ADDED.items() if at_least(since, release))
    return RECOMPUTE_MODULES + added
