"""Every change this project makes to megatron-core or torch, in one table, applied only when asked.

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
* ``local_mla``: building an MLA model on the local (non-TE) spec (``models/local_mla.py``);
* ``optimizer``: ``training/optim.build_optimizer``, with the optimizer (some rows fix that object);
* ``fsdp``: ``training/optim.wrap_model``, before Megatron-FSDP wraps a model (GPU and CPU alike);
* ``save``: around each synchronous checkpoint save (``checkpoint._mcore.save``), undone afterwards;
* ``inference``: ``generate/engine.py``, before it builds megatron-core's text-generation controller.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import queue
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_recipes.runtime import mcore_compat
from megatron_recipes.runtime.deferred_import import DeferredModule

SCOPES = ("process", "cpu_lane", "no_te", "local_mla", "optimizer", "fsdp", "save", "async_save", "inference")


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


# --- process: torch.compile deferred ------------------------------------------------------------


def _defer_torch_compile() -> None:
    """megatron-core decorates its fusion kernels with ``torch.compile`` at import time, which imports
    TorchDynamo/Inductor (~3 s per process) even when no fused kernel runs (the CPU lane). Compilation is
    lazy anyway; this only moves the import of its machinery to the first call of a compiled function."""
    original = torch.compile
    if getattr(original, "_megatron_recipes_deferred", False):
        return

    def deferred_compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...) with options
            return lambda fn: deferred_compile(fn, **kwargs)
        if not inspect.isfunction(model):
            return original(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **kwargs)
            return compiled(*args, **kw)

        return call

    deferred_compile._megatron_recipes_deferred = True
    torch.compile = deferred_compile


def _compile_imports_dynamo() -> bool:
    import sys

    import megatron.core.models.gpt  # noqa: F401  (its fusions call torch.compile at import)

    return "torch._dynamo" in sys.modules


# --- process: wandb imported on first use ------------------------------------------------------


_DEFERRED = ("wandb",)


def _defer_wandb_import() -> None:
    """megatron-core imports ``wandb`` at import time where installed (``timers``, the inference context),
    ~1 s of CPU per process, though only a run with ``logging.wandb_project`` uses it. The module is
    imported on first use instead, by megatron-core or by our tracker (which then gets the real one)."""
    for name in _DEFERRED:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:  # not installed: megatron-core's own ``except ImportError`` still sees that
            sys.modules[name] = DeferredModule(spec)


def _mcore_import_loads_wandb() -> bool:
    """Importing the megatron-core modules every run imports leaves wandb's package code loaded."""
    import megatron.core.inference.contexts.dynamic_context  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.timers  # noqa: F401

    return "wandb.sdk" in sys.modules


# --- cpu_lane: megatron-core's CUDA-only corners ------------------------------------------------


def _rng_on_cpu() -> None:
    import logging

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Inside a tracker fork the CPU generator *is* the forked state, so this warning is expected here.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


def _rng_set_misses_the_cpu_generator() -> bool:
    """The CUDA RNG setter never reaches the CPU generator the lane uses (it raises or queues a CUDA call)."""
    from megatron.core.tensor_parallel import random as mcore_random

    saved = torch.get_rng_state()
    torch.manual_seed(1)
    want = torch.get_rng_state()
    torch.manual_seed(2)
    try:
        mcore_random._set_cuda_rng_state(want)
        return not torch.equal(torch.get_rng_state(), want)
    except Exception:
        return True
    finally:
        torch.set_rng_state(saved)


def _define_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _te_general_gemm_undefined() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _grad_norm_in_float64() -> None:
    """megatron-core's fallback l2 norm (no Apex/TE) sums squares in float32 with ``torch.norm``, whose CPU
    rounding depends on the tensor's length: the same gradients sharded two ways gave norms 1.6e-5 apart
    (a 524288-element tensor is off 4.4e-6 on its own), above what ``check`` allows a layout. Summing in
    float64 makes the norm the same for every sharding (a float32 result, as before)."""
    from megatron.core.optimizer import clip_grads

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = [t.detach().double().square().sum() for tensors in tensor_lists for t in tensors]
        total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
        return total.float().reshape(1), None

    l2_norm._megatron_recipes = True
    clip_grads.l2_norm_impl = l2_norm


def _grad_norm_rounds_in_float32() -> bool:
    from megatron.core.optimizer import clip_grads

    if getattr(clip_grads.l2_norm_impl, "__module__", "").startswith(("amp_C", "transformer_engine")):
        return False  # Apex/TE kernels are not this fallback
    from megatron_recipes.runtime.cpu_lane import cuda_calls_on_cpu

    grad = torch.randn(524288, generator=torch.Generator().manual_seed(0))
    exact = grad.double().norm().item()
    with cuda_calls_on_cpu():  # the fallback makes its result with device="cuda"
        got = clip_grads.l2_norm_impl(2048 * 32, None, [[grad]], False)[0].item()
    return abs(got - exact) / exact > 1e-6


def _fsdp_telinear_class() -> None:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = type("NoTELinear", (), {})  # no module is one: the non-TE branch


def _fsdp_isinstance_telinear_raises() -> bool:
    """The adapter's ``isinstance(module, TELinear)`` raises (0.18 on it compares class names instead)."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    telinear = getattr(mcore_fsdp_adapter, "TELinear", None)
    if telinear is None:
        return False
    try:
        isinstance(torch.nn.Linear(1, 1), telinear)
        return False
    except TypeError:
        return True


# --- local_mla: MLA on the local spec -----------------------------------------------------------


def _mla_have_te_false() -> None:
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.HAVE_TE = False


def _mla_claims_te() -> bool:
    from megatron.core.transformer import multi_latent_attention as mla

    return bool(mla.HAVE_TE) and not isinstance(getattr(mla, "TELinear", None), type)


def _yarn_on_cpu() -> None:
    from megatron.core.transformer import multi_latent_attention

    original = multi_latent_attention.YarnRotaryEmbedding
    if torch.cuda.is_available() or getattr(original, "on_cpu", False):
        return

    class CpuYarnRotaryEmbedding(original):
        on_cpu = True

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_cpu_initialization", True)
            super().__init__(*args, **kwargs)

    multi_latent_attention.YarnRotaryEmbedding = CpuYarnRotaryEmbedding


def _yarn_built_for_cuda() -> bool:
    from megatron.core.transformer import multi_latent_attention as mla

    source = inspect.getsource(mla.MultiLatentAttention.__init__)
    call = source[source.index("YarnRotaryEmbedding(") :]
    return "use_cpu_initialization" not in call[: call.index(")")] and not getattr(mla.YarnRotaryEmbedding, "on_cpu", False)


def _sampling_rng_on_cpu() -> None:
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    cls = tgc.TextGenerationController
    if torch.cuda.is_available() or getattr(cls.__init__, "on_cpu", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        lane_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"  # only the controller's sampling generator reads it here
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = lane_device

    __init__.on_cpu = True
    cls.__init__ = __init__


def _sampling_rng_built_for_cuda() -> bool:
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    init = tgc.TextGenerationController.__init__
    return "torch.Generator(device=torch.cuda.current_device())" in inspect.getsource(init) and not getattr(init, "on_cpu", False)


def _pipeline_tensors_on_cpu() -> None:
    from megatron.core.inference import communication_utils

    if torch.cuda.is_available() or getattr(communication_utils._is_cuda, "on_cpu", False):
        return

    def _is_cuda(tensor):  # the lane's tensors are CPU tensors; what the check is for (a tensor is there) stays
        assert tensor is not None

    _is_cuda.on_cpu = True
    communication_utils._is_cuda = _is_cuda


def _pipeline_tensors_must_be_cuda() -> bool:
    from megatron.core.inference import communication_utils

    check = communication_utils._is_cuda
    return "tensor.is_cuda" in inspect.getsource(check) and not getattr(check, "on_cpu", False)


# --- optimizer: megatron-core's plain-torch optimizer path (no Apex, no TE) ---------------------


def _allocate_torch_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its state now (zeros, step 0): what its first step creates, so numerics
    do not change, and ``DistributedOptimizer.state_dict()`` (which asserts a ``step``) can load."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _state_dict_asserts_step() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.state_dict)
    return "step" in source and "assert" in source


_SIBLING_STEP = "__megatron_recipes_sibling_step__"


def _step_from_siblings(optimizer) -> None:
    """A chained optimizer with no parameter on this rank (the expert optimizer of a pipeline stage whose
    layers are all dense) has no Adam state, so ``DistributedOptimizer.state_dict()`` finds no step and
    asserts. Rank 0 writes the common state for every rank, so the step it writes must be the true one:
    the step of a sibling optimizer on this rank (all parts of a chain step together)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]

    def sibling_step():
        for part in parts:
            for state in getattr(getattr(part, "optimizer", None), "state", {}).values():
                if isinstance(state, dict) and torch.is_tensor(state.get("step")):
                    return state["step"].clone()
        return torch.tensor(0.0)  # no part holds state: nothing has stepped yet

    for part in parts:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or any(g["params"] for g in inner.param_groups):
            continue
        if getattr(part.state_dict, "_megatron_recipes_sibling_step", False):
            continue
        original = part.state_dict

        def state_dict(original=original, inner=inner):
            inner.state[_SIBLING_STEP] = {"step": sibling_step()}  # a non-tensor key: torch keeps it as is
            try:
                return original()
            finally:
                inner.state.pop(_SIBLING_STEP, None)

        state_dict._megatron_recipes_sibling_step = True
        part.state_dict = state_dict


def _empty_optimizer_asserts_step() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.state_dict)
    return "assert len(steps) == 1" in source


def _keep_step_on_reshardable_load(optimizer=None) -> None:
    """``load_parameter_state_from_fully_reshardable`` passes tensors without ``step`` and the setter copies
    every key of the live state: ``KeyError: 'step'``. Keep the ``step`` ``load_state_dict`` restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_megatron_recipes_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    set_states._megatron_recipes_keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _setter_copies_every_key() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    setter = DistributedOptimizer._set_main_param_and_optimizer_states
    return not getattr(setter, "_megatron_recipes_keeps_step", False) and '"step"' not in inspect.getsource(setter)


def _init_sgd_state(opt, config=None) -> None:
    for group in opt.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            state = opt.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _sgd_state_for_loading(optimizer) -> None:
    """Zero momentum buffers the checkpoint then overwrites (with dampening 0, torch's first-step
    ``clone(grad)`` equals ``momentum * 0 + grad``; with momentum 0 torch keeps no state at all)."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(getattr(part, "optimizer", None), torch.optim.SGD) and getattr(part, "init_state_fn", 0) is None:
            part.init_state_fn = _init_sgd_state


def _sgd_has_no_init_state_fn() -> bool:
    from megatron.core import optimizer as mcore_optimizer

    source = inspect.getsource(mcore_optimizer)
    return "init_state_fn = None" in source


# --- fsdp: Megatron-FSDP's reduction of an unsharded gradient buffer -----------------------------

_UNSHARDED = "_megatron_recipes_unsharded_grad_reduce"


def _reduce_unsharded_grads_once() -> None:
    """Megatron-FSDP's hook-driven reduction of an *unsharded* gradient buffer (zero1 at any DP size; every
    mode at DP=1, where nothing is sharded) reads the bucket that *is* that buffer, reduces it into a fresh
    tensor and adds the result back (``local_grad += reduced_grad``, meant for a sharded buffer's separate
    bucket): each reduction doubles the accumulated gradients at DP=1 (x2 with one micro-batch; under zero2/zero3,
    which reduce every micro-batch, buf = 2 * (buf + g)), and at DP>1 zero1 gets its own gradient plus the sum
    (and, with ``overlap_grad_reduce=False``, a second reduction in ``finish_grad_sync``: x2). For unsharded buffers
    this makes the reduction happen once per step and replace this rank's shard:

    * one-rank group: a sum over one rank is the buffer itself: bookkeeping only;
    * ``overlap_grad_reduce=False``: ``finish_grad_sync`` reduce-scatters the buffer in place: bookkeeping only;
    * otherwise: reduce-scatter into a fresh tensor (synchronously) and copy it into this rank's shard.

    Sharded buffers, outer-DP (HSDP) reduction and one-rank groups with a scaling factor other than 1 (not
    per-token loss) stay megatron-core's."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    original = pgb.GradReducePipeline._bucket_group_gradient_reduce
    if getattr(original, _UNSHARDED, False):
        return

    def bucket_group_gradient_reduce(self, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
        buffers = [self.get_fsdp_buffer(b) for b in bucket_group]
        one_rank = all(b.data_parallel_group.size() == 1 for b in buffers)
        if (
            outer_fsdp_group_grad_reduce
            or any(b.is_data_distributed for b in buffers)
            or (one_rank and any(b.gradient_scaling_factor not in (None, 1.0) for b in buffers))
        ):
            return original(self, bucket_group, async_op=async_op, outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)
        if not one_rank and self.buffer.ddp_config.overlap_grad_reduce:
            from megatron_recipes.runtime import collectives

            for gbuf in buffers:
                bucket = gbuf.fetch_bucket()  # a view of the whole unsharded buffer
                op = pgb.gradient_reduce_preprocessing(bucket.data, gbuf.gradient_scaling_factor, gbuf.ddp_config)
                reduced = torch.empty_like(gbuf.get_shard_from_bucket(bucket))
                collectives.reduce_scatter_tensor(reduced, bucket.data, op=op, group=gbuf.data_parallel_group)
                gbuf.get_shard_from_local_buffer().copy_(reduced)
        for bucket_id in bucket_group:  # what megatron-core's free-up step does for an unsharded buffer
            self.bucket_grad_ready_params[bucket_id] = set()
            self.bucket_status[bucket_id] = pgb.BucketStatus.EMPTY
        return True

    setattr(bucket_group_gradient_reduce, _UNSHARDED, True)
    pgb.GradReducePipeline._bucket_group_gradient_reduce = bucket_group_gradient_reduce


def _unsharded_grad_reduce_adds_back() -> bool:
    """Reads the source (the defect shows only across two ranks): the accumulation line is in 0.16's method
    and in 0.17's rewrite of it. The behaviour is ``tests/test_fsdp_gradients.py``: on 0.19.2 without this
    row one rank is right but zero1 at DP=2 without overlap_grad_reduce logs grad norm 11.57 against DDP's 7.44."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    method = pgb.GradReducePipeline._bucket_group_gradient_reduce
    source = inspect.getsource(method)
    # 0.16's accumulation line, run for sharded and unsharded buffers alike
    return not getattr(method, _UNSHARDED, False) and "local_grad += reduced_grad" in source


# --- save: the checkpoint writer's results queue -------------------------------------------------


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """For one synchronous save, an in-process results queue instead of megatron-core's spawn Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        import logging

        logging.getLogger(__name__).warning(
            "this megatron-core's checkpoint writer has no _results_queue slot; its own multiprocessing queue "
            "is used, so the entry script needs an `if __name__ == \"__main__\":` guard"
        )
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _writer_starts_a_spawn_manager() -> bool:
    """Asked for its results queue, the writer starts a ``multiprocessing`` Manager process (its queue is a
    proxy to it); the Manager started here is shut down again and the writer's slot left as found."""
    from multiprocessing.managers import BaseProxy

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:  # a queue is already there: nothing gets started
        return isinstance(filesystem_async._results_queue, BaseProxy)
    made = mcore_compat.write_results_queue_getter()()
    filesystem_async._results_queue = None
    manager = getattr(made, "_manager", None)
    if manager is not None:
        manager.shutdown()
    return isinstance(made, BaseProxy)


_FORK_MANAGER: List[Any] = []  # [manager, queue]: one per process, started on the first async save


@contextlib.contextmanager
def _forked_write_results() -> Iterator[None]:
    """For an async save: a results queue served by a *fork*-started Manager (the write runs in another
    process, so the queue must cross processes; a fork child does not re-import the entry script)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _FORK_MANAGER:
        manager = multiprocessing.get_context("fork").Manager()
        queue_ = manager.Queue()
        queue_._megatron_recipes_fork = True
        _FORK_MANAGER.extend([manager, queue_])
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = _FORK_MANAGER[1]
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _async_writer_starts_a_spawn_manager() -> bool:
    """The queue an async save would get is a spawn-started Manager's (ours is marked as fork-started)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    slot = filesystem_async._results_queue
    if slot is not None:
        return not getattr(slot, "_megatron_recipes_fork", False)
    return _writer_starts_a_spawn_manager()


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
    Patch("grad-norm-float64", "cpu_lane", "megatron.core.optimizer.clip_grads:l2_norm_impl", ("0.16", None),
          "without Apex/TE the gradient norm is a float32 torch.norm whose CPU rounding depends on how a tensor is "
          "sharded: one model's norm differed 1.6e-5 between TP=1 and TP=2, so check called a right layout wrong",
          "tests/test_patches.py::test_grad_norm_is_the_same_for_every_sharding", _grad_norm_in_float64,
          _grad_norm_rounds_in_float32, without_cuda=True),
    Patch("fsdp-telinear", "no_te", "megatron.core.distributed.fsdp.mcore_fsdp_adapter:TELinear", ("0.16", "0.18"),
          "Megatron-FSDP's adapter calls isinstance(module, TELinear); without TE that is a MagicMock, not a class "
          "(0.18 compares class names and imports no TELinear)",
          "tests/test_sharding_equivalence.py", _fsdp_telinear_class, _fsdp_isinstance_telinear_raises),
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
