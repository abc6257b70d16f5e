"""Machine rules (scope ``machine``): what the machine a run starts on can honour.

The recipe rules judge a recipe against the cluster it declares; these judge it against the machine it
is actually running on (``host.machine``: GPU, Transformer Engine, DeepEP, compute capability, as
``models.capabilities.detect`` finds them). A setting that cannot be honoured here is an error, never a
silent downgrade (a run that trains something other than its recipe is worse than none). `train` and
`check` run them through ``capabilities.require_supported``.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import Host, rule
from megatron_recipes.validation.rules_data import packed_thd_needs_mbs1


def _te(host: Host) -> bool:
    return bool(host.machine.transformer_engine and host.machine.cuda)


def _where(host: Host) -> str:
    return "this machine has no GPU" if not host.machine.cuda else "Transformer Engine is not importable here"


@rule("machine.fp8_needs_te", ["precision.fp8"], "FP8 runs on Transformer Engine on a GPU",
      "use precision=bf16 (or fp32 on CPU)", scope="machine")
def _fp8_te(cfg: RunConfig, host: Host) -> Optional[str]:
    fp8 = cfg.precision.fp8
    if fp8 and not _te(host):
        return f"precision.fp8={fp8} needs Transformer Engine on a GPU, but {_where(host)}; use precision=bf16 (or fp32 on CPU)"
    return None


@rule("machine.fp4_needs_te", ["precision.fp4"], "FP4 runs on Transformer Engine on a Blackwell GPU",
      "use precision=bf16", scope="machine")
def _fp4_te(cfg: RunConfig, host: Host) -> Optional[str]:
    fp4 = cfg.precision.fp4
    if fp4 and not _te(host):
        return f"precision.fp4={fp4} needs Transformer Engine on a Blackwell GPU, but {_where(host)}; use precision=bf16"
    return None


@rule("machine.cp_attention", ["parallel.cp", "parallel.cp_comm_type"],
      "without Transformer Engine, context parallelism uses the local spec's all_gather attention",
      "use parallel.cp_comm_type=all_gather", scope="machine")
def _cp_attention(cfg: RunConfig, host: Host) -> Optional[str]:
    p = cfg.parallel
    if p.cp > 1 and not _te(host) and p.cp_comm_type != "all_gather":
        return (f"parallel.cp={p.cp} with cp_comm_type={p.cp_comm_type} needs Transformer Engine's attention, but "
                f"{_where(host)}; the local spec's CP attention all-gathers keys/values: use parallel.cp_comm_type=all_gather")
    return None


@rule("machine.packed_thd", ["data.packing", "train.micro_batch_size"],
      "with Transformer Engine, packed sequences (THD) run one packed row per micro batch",
      "set train.micro_batch_size=1 (raise train.seq_length to pack more) or data.packing=false", scope="machine")
def _packed_thd(cfg: RunConfig, host: Host) -> Optional[str]:
    thd = packed_thd_needs_mbs1(cfg) if _te(host) else None
    if thd:
        return f"{thd}; set train.micro_batch_size=1 (raise train.seq_length to pack more) or data.packing=false"
    return None


@rule("machine.flex_needs_deep_ep", ["parallel.moe_dispatcher"], "the flex MoE dispatcher needs DeepEP on a GPU",
      "use parallel.moe_dispatcher=alltoall", scope="machine")
def _flex(cfg: RunConfig, host: Host) -> Optional[str]:
    if cfg.parallel.moe_dispatcher == "flex" and not host.machine.deep_ep:
        return ("parallel.moe_dispatcher=flex needs DeepEP (deep_ep) on a GPU, which is not importable here; "
                "use parallel.moe_dispatcher=alltoall")
    return None


@rule("machine.optimizer_offload", ["optimizer.cpu_offload"],
      "optimizer offload runs on the precision-aware optimizer path (a GPU and Transformer Engine)",
      "set optimizer.cpu_offload=false", scope="machine")
def _optimizer_offload(cfg: RunConfig, host: Host) -> Optional[str]:
    if cfg.optimizer.cpu_offload and not _te(host):  # HybridDeviceOptimizer runs on the precision-aware path
        return f"optimizer.cpu_offload needs a GPU and Transformer Engine, but {_where(host)}; set optimizer.cpu_offload=false"
    return None


@rule("machine.activation_offload", ["train.activation_offload_layers"],
      "activation offload uses Transformer Engine's offload context on a GPU",
      "set train.activation_offload_layers=0", scope="machine")
def _activation_offload(cfg: RunConfig, host: Host) -> Optional[str]:
    if cfg.train.activation_offload_layers > 0 and not _te(host):  # TransformerBlock: get_cpu_offload_context is TE's
        return f"train.activation_offload_layers needs Transformer Engine on a GPU, but {_where(host)}; set it to 0"
    return None


@rule("machine.fp16_needs_gpu", ["precision.params_dtype"], "fp16 parameters need a GPU",
      "use precision=fp32 or bf16", scope="machine")
def _fp16(cfg: RunConfig, host: Host) -> Optional[str]:
    if cfg.precision.params_dtype == "fp16" and not host.machine.cuda:
        return "precision.params_dtype=fp16 is not supported on the CPU lane; use precision=fp32 or bf16"
    return None


@rule("machine.fp8_compute_capability", ["precision.fp8"], "FP8 needs compute capability >= 8.9 (Ada/Hopper)",
      "use precision=bf16 on this GPU", scope="machine")
def _fp8_cc(cfg: RunConfig, host: Host) -> Optional[str]:
    m = host.machine
    if cfg.precision.fp8 and m.cuda and m.compute_capability < (8, 9):
        return f"precision.fp8 needs compute capability >= 8.9 (Ada/Hopper), this GPU is {m.compute_capability}"
    return None


@rule("machine.blackwell", ["precision.fp4", "precision.fp8_recipe"],
      "MXFP8 and NVFP4 need a Blackwell GPU (compute capability >= 10.0)",
      "use precision=fp8_blockwise (Hopper) or bf16 on this GPU", scope="machine")
def _blackwell(cfg: RunConfig, host: Host) -> Optional[str]:
    prec, m = cfg.precision, host.machine
    if (prec.fp4 or prec.fp8_recipe == "mxfp8" and prec.fp8) and m.cuda and m.compute_capability < (10, 0):
        return f"MXFP8/NVFP4 need a Blackwell GPU (compute capability >= 10.0), this GPU is {m.compute_capability}"
    return None


MACHINE_RULES = [
    _fp8_te, _fp4_te, _cp_attention, _packed_thd, _flex, _optimizer_offload, _activation_offload, _fp16, _fp8_cc,
    _blackwell,
]
