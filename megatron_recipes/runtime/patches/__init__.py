"""Every change this project makes to megatron-core or torch, in one table, applied only when asked.

The table and its machinery are here; each row's fix and defect probe live in the module of its scopes
(``_process``, ``_lane``: the CPU lane, no-TE, local MLA and inference corners, ``_optimizer``, ``_writes``:
FSDP's gradient reduction and the checkpoint writer).

Each row says what it replaces (``target``), the megatron-core releases that need it (``versions``, read
from each release's source: 0.16.1, 0.17.1, 0.18.2, 0.19.2), why, and the test that proves it; a row is
applied only inside its range. ``defect`` probes the *unpatched* library for the bug, by what it does where
that can be run in one process, so ``tests/test_patches.py`` fails when a row is needed outside its range,
when it is in range but no longer needed (fixed upstream: end the range), and when a patch stops working
(the defect is still there after ``apply``). Nothing is patched on import: a scope is applied where it
begins, explicitly:

* ``process``: the entry points (``megatron-recipes``, ``python -m megatron_recipes.train``), before
  megatron-core is imported;
* ``cpu_lane``: ``runtime/cpu_lane.activate`` (no CUDA);
* ``no_te``: building a model where Transformer Engine does not import (``models/builder.py``), GPU or CPU:
  megatron-core's TE fallbacks that break there, whatever the device;
* ``model``: building any model (``models/builder.py``), GPU or CPU: what every run of the model executes;
* ``local_mla``: building an MLA model on the local (non-TE) spec (``models/local_mla.py``);
* ``optimizer``: ``training/optim.build_optimizer``, with the optimizer (some rows fix that object);
* ``fsdp``: ``training/optim.wrap_model``, before Megatron-FSDP wraps a model (GPU and CPU alike);
* ``save``: around each synchronous checkpoint save (``checkpoint._mcore.save``), undone afterwards;
* ``inference``: ``generate/engine.py``, before it builds megatron-core's text-generation controller.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_recipes.runtime import mcore_compat
# the rows' fixes and defect probes, one module per group of scopes
from megatron_recipes.runtime.patches._process import (
    _defer_torch_compile,
    _compile_imports_dynamo,
    _defer_wandb_import,
    _mcore_import_loads_wandb,
)
from megatron_recipes.runtime.patches._lane import (
    _rng_on_cpu,
    _rng_set_misses_the_cpu_generator,
    _define_te_general_gemm,
    _te_general_gemm_undefined,
    _grad_norm_in_float64,
    _grad_norm_rounds_in_float32,
    _fsdp_telinear_class,
    _fsdp_isinstance_telinear_raises,
    _no_te_recompute_contexts,
    _recompute_without_output_needs_te,
    _mla_have_te_false,
    _mla_claims_te,
    _yarn_on_cpu,
    _yarn_built_for_cuda,
    _sampling_rng_on_cpu,
    _sampling_rng_built_for_cuda,
    _pipeline_tensors_on_cpu,
    _pipeline_tensors_must_be_cuda,
)
from megatron_recipes.runtime.patches._model import (
    _scale_aux_loss_by_micro_batch_tokens,
    _aux_loss_counts_the_routers_share_of_tokens,
)
from megatron_recipes.runtime.patches._optimizer import (
    _allocate_torch_adam_state,
    _state_dict_asserts_step,
    _step_from_siblings,
    _empty_optimizer_asserts_step,
    _keep_step_on_reshardable_load,
    _setter_copies_every_key,
    _sgd_state_for_loading,
    _sgd_has_no_init_state_fn,
)
from megatron_recipes.runtime.patches._writes import (
    _reduce_unsharded_grads_once,
    _unsharded_grad_reduce_adds_back,
    _in_process_write_results,
    _writer_starts_a_spawn_manager,
    _forked_write_results,
    _async_writer_starts_a_spawn_manager,
)

SCOPES = ("process", "cpu_lane", "no_te", "model", "local_mla", "optimizer", "fsdp", "save", "async_save", "inference")


@dataclass(frozen=True)
class Patch:
    name: str
    scope: str
    target: str  # "module:attribute" replaced, or the object a fix is applied to
    versions: Tuple[str, Optional[str]]  # megatron-core [first needing it, first not needing it); None: all since
    reason: str
    test: str  # "tests/file.py::test_name" proving it needed and working
    apply: Callable[..., Any]
    defect: Callable[[], bool]  # True while the unpatched library still shows the bug here
    on_object: bool = False  # fixes the object passed to ``apply`` (its test proves it works), not a module
    without_cuda: bool = False  # the defect exists only on a machine without CUDA
    requires: Optional[str] = None  # a module that must be installed for the defect to exist (wandb)


_OPT = "tests/test_checkpoint_resharding.py"
PATCHES: List[Patch] = [
    Patch("defer-torch-compile", "process", "torch:compile", ("0.16", None),
          "megatron-core's fusions call torch.compile at import, importing TorchDynamo/Inductor (~3 s) in "
          "every process, also where no fused kernel runs", "tests/test_cpu_lane.py::test_announces_itself_once_and_compile_stays_lazy",
          _defer_torch_compile, _compile_imports_dynamo),
    Patch("defer-wandb-import", "process", "sys.modules['wandb']", ("0.16", None),
          "megatron-core imports wandb at import time where it is installed (~1 s of CPU per process), "
          "also in runs that log nowhere but to files", "tests/test_patches.py::test_wandb_is_imported_on_first_use",
          _defer_wandb_import, _mcore_import_loads_wandb, requires="wandb"),
    Patch("cpu-rng-state", "cpu_lane", "megatron.core.tensor_parallel.random:_get_cuda_rng_state,_set_cuda_rng_state",
          ("0.16", None), "the RNG tracker reads/writes torch.cuda.default_generators; on the lane the CUDA RNG "
          "is the CPU generator", "tests/test_cpu_lane.py", _rng_on_cpu, _rng_set_misses_the_cpu_generator,
          without_cuda=True),
    Patch("moe-te-general-gemm", "no_te", "megatron.core.transformer.moe.moe_utils:te_general_gemm", ("0.16", "0.17"),
          "the router's GEMM helper tests a name left undefined when Transformer Engine is absent (0.17 defines it None)",
          "tests/test_parallel_equivalence.py", _define_te_general_gemm, _te_general_gemm_undefined),
    Patch("moe-aux-loss-token-count", "model",
          "megatron.core.transformer.moe.router:TopKRouter.attach_and_log_load_balancing_loss,_apply_seq_aux_loss",
          ("0.16", "0.19"), "with per-token loss the router's aux loss is scaled by the tokens this rank routes, not "
          "by the micro-batch the loss function counts: under SP (or CP) each TP x CP rank routes 1/(TP x CP) of it, "
          "so the load-balancing gradient was 1/(TP x CP) of one rank's (Qwen3-235B at TP2: grad norm 1.4e-4 off "
          "at step 1), and seq_aux_loss's another 1/micro_batch_size (0.19 counts the whole micro-batch)",
          "tests/test_moe_aux_loss.py", _scale_aux_loss_by_micro_batch_tokens,
          _aux_loss_counts_the_routers_share_of_tokens),
    Patch("grad-norm-float64", "cpu_lane", "megatron.core.optimizer.clip_grads:l2_norm_impl", ("0.16", None),
          "without Apex/TE the gradient norm is a float32 torch.norm whose CPU rounding depends on how a tensor is "
          "sharded: one model's norm differed 1.6e-5 between TP=1 and TP=2, so check called a right layout wrong",
          "tests/test_patches.py::test_grad_norm_is_the_same_for_every_sharding", _grad_norm_in_float64,
          _grad_norm_rounds_in_float32, without_cuda=True),
    Patch("fsdp-telinear", "no_te", "megatron.core.distributed.fsdp.mcore_fsdp_adapter:TELinear", ("0.16", "0.18"),
          "Megatron-FSDP's adapter calls isinstance(module, TELinear); without TE that is a MagicMock, not a class "
          "(0.18 compares class names and imports no TELinear)",
          "tests/test_sharding_equivalence.py", _fsdp_telinear_class, _fsdp_isinstance_telinear_raises),
    Patch("checkpoint-without-output-no-te", "no_te",
          "megatron.core.tensor_parallel.random:FP8GlobalStateManager,activation_recompute_forward,fp8_autocast",
          ("0.16", None), "CheckpointWithoutOutput() (layernorm recompute) reads its default fp8=False as the FP8 "
          "path and names TE's FP8 state, defined only where TE imports: a NameError without TE",
          "tests/test_recompute.py::test_selective_recompute_trains_like_no_recompute",
          _no_te_recompute_contexts, _recompute_without_output_needs_te),
    Patch("inference-sampling-rng", "inference",
          "megatron.core.inference.text_generation_controllers.text_generation_controller:TextGenerationController.__init__",
          ("0.16", None), "the text-generation controller builds its sampling generator on torch.cuda.current_device(); "
          "the lane's device index 0 is CUDA to torch.Generator, which then fails without an accelerator",
          "tests/test_generate.py", _sampling_rng_on_cpu, _sampling_rng_built_for_cuda, without_cuda=True),
    Patch("inference-pipeline-tensors", "inference", "megatron.core.inference.communication_utils:_is_cuda",
          ("0.16", None), "the inference loop's pipeline send/receive/broadcast helpers assert CUDA tensors, so PP>1 "
          "generation stops at its first stage boundary on the CPU lane", "tests/test_generate.py",
          _pipeline_tensors_on_cpu, _pipeline_tensors_must_be_cuda, without_cuda=True),
    Patch("mla-have-te", "local_mla", "megatron.core.transformer.multi_latent_attention:HAVE_TE", ("0.16", "0.17"),
          "the module reports HAVE_TE with MagicMock placeholders for TE's classes, then isinstance()s them "
          "(0.17 takes HAVE_TE from its TE extension: False without TE)",
          "tests/test_train_local_spec.py", _mla_have_te_false, _mla_claims_te),
    Patch("mla-yarn-on-cpu", "local_mla", "megatron.core.transformer.multi_latent_attention:YarnRotaryEmbedding",
          ("0.16", None), "MLA builds its YaRN embedding without use_cpu_initialization: torch.device(0) without CUDA",
          "tests/test_train_local_spec.py", _yarn_on_cpu, _yarn_built_for_cuda, without_cuda=True),
    Patch("adam-state-up-front", "optimizer", "torch.optim.Adam state (the optimizer built)", ("0.16", None),
          "DistributedOptimizer.state_dict() asserts each parameter has a step; a fresh torch Adam has none, "
          "so loading a checkpoint into it fails", _OPT, _allocate_torch_adam_state, _state_dict_asserts_step, True),
    Patch("step-for-an-empty-optimizer", "optimizer", "DistributedOptimizer.state_dict of a part holding no parameter",
          ("0.16", None), "without Apex/TE state_dict() reads the step from Adam state; an optimizer with no "
          "parameter on this rank (experts on a dense-only stage) has none and asserts on save",
          "tests/test_checkpoint_resharding.py::test_resume_with_a_stage_that_holds_no_experts",
          _step_from_siblings, _empty_optimizer_asserts_step, True),
    Patch("keep-step-on-reshardable-load", "optimizer",
          "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
          ("0.16", None), "fully_reshardable loads hand it tensors without step: KeyError 'step'", _OPT,
          _keep_step_on_reshardable_load, _setter_copies_every_key),
    Patch("sgd-init-state-fn", "optimizer", "init_state_fn of megatron-core's SGD (the optimizer built)", ("0.16", None),
          "get_megatron_optimizer leaves SGD's init_state_fn None, which loading calls: an SGD run cannot resume",
          "tests/test_checkpoint_sgd.py", _sgd_state_for_loading, _sgd_has_no_init_state_fn, True),
    Patch("fsdp-unsharded-grad-reduce", "fsdp",
          "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:GradReducePipeline._bucket_group_gradient_reduce",
          ("0.16", None), "an unsharded grad buffer (zero1; any mode at DP=1) is reduced into a copy that is added back "
          "onto it, and zero1 without overlap_grad_reduce reduces again: gradients x2 per reduction at DP=1 (x2, x3, x7.5 "
          "at 1, 2, 4 micro-batches under zero3), x2 under zero1 at DP=2, silently (0.17-0.19's rewrite fixes one rank, not "
          "zero1 at DP=2)", "tests/test_fsdp_gradients.py",
          _reduce_unsharded_grads_once, _unsharded_grad_reduce_adds_back),
    Patch("in-process-write-results", "save", "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
          ("0.16", None), "the writer's results queue is a spawn Manager, whose child re-imports the entry script "
          "(an unguarded one trains again and hangs the save); a synchronous save needs no Manager",
          "tests/test_checkpoint_kill.py", _in_process_write_results, _writer_starts_a_spawn_manager),
    Patch("forked-write-results", "async_save", "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
          ("0.16", None), "an async save's write results cross processes, and the writer's queue is a spawn Manager, "
          "whose child re-imports the entry script (an unguarded one trains again and hangs the save)",
          "tests/test_checkpoint_async.py", _forked_write_results, _async_writer_starts_a_spawn_manager),
]

_APPLIED: set = set()


def can_occur_here(patch: Patch) -> bool:
    """The row's defect can exist on this machine at all (no CUDA where it needs none; its module installed)."""
    if patch.without_cuda and torch.cuda.is_available():
        return False
    return patch.requires is None or importlib.util.find_spec(patch.requires) is not None


def in_range(patch: Patch, release: Optional[str] = None) -> bool:
    return mcore_compat.in_range(*patch.versions, release=release)


def applies_here(patch: Patch) -> bool:
    """The installed megatron-core is in the row's range, and the row's defect can occur on this machine."""
    return in_range(patch) and can_occur_here(patch)


def rows(scope: str) -> List[Patch]:
    if scope not in SCOPES:
        raise ValueError(f"unknown patch scope {scope!r}; one of {SCOPES}")
    return [p for p in PATCHES if p.scope == scope and applies_here(p)]


def apply(scope: str, *objects: Any) -> List[str]:
    """Apply the rows of ``scope`` (module patches once per process; object fixes to ``objects``); their names.

    ``process`` (every entry point, first) refuses a megatron-core outside the supported range: the rows
    are known right only inside it."""
    if scope == "process":
        mcore_compat.require_supported()
    names = []
    for patch in rows(scope):
        if patch.on_object:
            if not objects:
                continue  # nothing to fix without the object
            patch.apply(*objects)
        elif patch.name not in _APPLIED:
            patch.apply()
            _APPLIED.add(patch.name)
        names.append(patch.name)
    return names


@contextlib.contextmanager
def applied(scope: str) -> Iterator[None]:
    """Context-manager rows of ``scope`` (``save``), in force for the ``with`` block only."""
    with contextlib.ExitStack() as stack:
        for patch in rows(scope):
            stack.enter_context(patch.apply())
        yield


def defects() -> Dict[str, bool]:
    """Each row that applies here: does the library (as patched so far in this process) show its bug?"""
    return {p.name: bool(p.defect()) for p in PATCHES if applies_here(p)}


def defects_in_and_out_of_range() -> Dict[str, Dict[str, bool]]:
    """Every row whose defect can occur on this machine, in range or not: ``{"in_range", "defect"}``; the
    test that a row is needed exactly where its range says (run on an unpatched library)."""
    return {p.name: {"in_range": in_range(p), "defect": bool(p.defect())} for p in PATCHES if can_occur_here(p)}
