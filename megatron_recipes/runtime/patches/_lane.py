"""Rows for megatron-core's CUDA-only and Transformer-Engine-only corners (scopes ``cpu_lane``, ``no_te``,
``local_mla``, ``inference``): what the CPU lane and the local spec need.

Each ``_fix`` / ``_defect`` pair is one row of the table in ``runtime/patches/__init__.py``.
"""

from __future__ import annotations

import functools
import inspect

import torch



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


class _NoFP8:
    """Transformer Engine's FP8 state where TE is absent: FP8 is never on."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def _no_te_recompute_contexts() -> None:
    """``CheckpointWithoutOutput()`` (the layernorm and moe_act recompute) defaults to ``fp8=False``, which its
    ``fp8 is not None`` reads as the FP8 path: it then asks TE's FP8GlobalStateManager and enters TE's
    recompute contexts, names tensor_parallel/random.py defines only when TE imports. Without TE no module
    runs in FP8, so the FP8 state is off and the contexts are empty (what TE's own do outside FP8)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mcore_random

    if not hasattr(mcore_random, "FP8GlobalStateManager"):
        mcore_random.FP8GlobalStateManager = _NoFP8
        mcore_random.activation_recompute_forward = lambda **_: contextlib.nullcontext()
        mcore_random.fp8_autocast = lambda **_: contextlib.nullcontext()


def _recompute_without_output_needs_te() -> bool:
    """A default CheckpointWithoutOutput takes the FP8 path, whose TE names are undefined."""
    from megatron.core.tensor_parallel import random as mcore_random

    return bool(mcore_random.CheckpointWithoutOutput().fp8) and not hasattr(mcore_random, "FP8GlobalStateManager")


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
        if tensor is None:
            raise RuntimeError("a pipeline stage received no tensor to pass on (megatron-core's _is_cuda check)")

    _is_cuda.on_cpu = True
    communication_utils._is_cuda = _is_cuda


def _pipeline_tensors_must_be_cuda() -> bool:
    from megatron.core.inference import communication_utils

    check = communication_utils._is_cuda
    return "tensor.is_cuda" in inspect.getsource(check) and not getattr(check, "on_cpu", False)
