"""Rules on expert-parallel communication overlap (``parallel.overlap_moe_expert_parallel_comm``, megatron-core's
combined 1F1B schedule) and deferred weight gradients (``parallel.delay_wgrad_compute``).

megatron-core asserts most of these in ``TransformerConfig.__post_init__`` (0.16.1 transformer_config.py
1852-1926), which runs on every rank after the job has waited in the queue; here they are refused before
anything starts, each with its fix. Where releases differ the rule is the oldest supported release's
(0.16, as rules_sharding.py), and says which release lifts it (runtime/mcore_compat.py lists the
differences): MTP without pipeline parallelism (0.18 lifts it), Megatron-FSDP (0.18 supports it without
virtual stages). What megatron-core does not check is here too: layer offloading it would silently skip, and a
single hardware queue that serialises the overlap away.

What users report deadlocking: empty pipeline stages (Megatron-LM #1852) are refused by rule
pp.pipeline_layout. #1810 is a GPU race (one CUDA event orders a chunk's compute- and communication-stream
work, so collectives on different communicators can start in different orders on different ranks); its
reporter adds in #1852 that odd numbers of MoE layers "seem to" trigger it, but no layout condition is
established, and NVIDIA's own runs keep odd counts (the published Qwen3-235B-A22B run: 3 MoE layers per
virtual stage; Megatron-LM's functional tests: a stage holding one MoE layer and the MTP layer), so no layout
is refused for it. The CPU lane runs such layouts (tests/test_ep_overlap.py: stages of 1 and 3 layers), which proves the schedule's
pairing of forward and backward layers, not the GPU streams' timing.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import Host, is_gpu, rule

OVERLAP = "parallel.overlap_moe_expert_parallel_comm"
DISPATCHERS = ("alltoall", "flex")  # megatron-core's only dispatchers with split dispatch/combine nodes
HALF_PRECISION = ("bf16", "fp16")
# Transformer Engine releases for deferred weight gradients (Megatron-LM arguments.py): 2.3 has the option
# (megatron-core's TE linears raise below it), 2.7 is required without gradient_accumulation_fusion, 2.8 with
# overlap_grad_reduce (DDP's reduction hook must then wait for backward_dw: megatron-core's DDP registers it on
# the module for parameters TE marks skip_backward_post_hook, distributed_data_parallel.py 320-340)
TE_DELAY_WGRAD = (2, 7)
TE_DELAY_WGRAD_OVERLAP_GRAD_REDUCE = (2, 8)


def _on(cfg: RunConfig) -> bool:
    return bool(cfg.parallel.overlap_moe_expert_parallel_comm)


@rule(
    "ep_overlap.needs_ep",
    [OVERLAP, "parallel.ep", "model.num_moe_experts"],
    "EP communication overlap hides expert-parallel all-to-alls: a mixture-of-experts model with parallel.ep > 1",
    "set parallel.ep>1 on a MoE model, or parallel.overlap_moe_expert_parallel_comm=false",
)
def _needs_ep(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if not _on(cfg):
        return None
    if not derived.is_moe(cfg.model):
        return f"{OVERLAP}=true on model {cfg.model.name}, which has no experts"
    if p.ep <= 1:
        return f"{OVERLAP}=true with parallel.ep={p.ep}: there is no expert-parallel all-to-all to hide; set parallel.ep>1"
    return None


@rule(
    "ep_overlap.dispatcher",
    [OVERLAP, "parallel.moe_dispatcher"],
    "EP communication overlap runs the alltoall or flex token dispatcher (their dispatch and combine are separate steps)",
    "set parallel.moe_dispatcher=alltoall (or flex)",
)
def _dispatcher(cfg: RunConfig) -> Optional[str]:
    d = cfg.parallel.moe_dispatcher
    if _on(cfg) and derived.is_moe(cfg.model) and d not in DISPATCHERS:
        return f"{OVERLAP}=true with parallel.moe_dispatcher={d}; use parallel.moe_dispatcher in {{{', '.join(DISPATCHERS)}}}"
    return None


@rule(
    "ep_overlap.precision",
    [OVERLAP, "precision.params_dtype"],
    "EP communication overlap needs bf16 or fp16 parameters (FP8 recipes keep bf16 parameters)",
    "use precision=bf16 (or an FP8 precision group)",
)
def _precision(cfg: RunConfig) -> Optional[str]:
    dtype = cfg.precision.params_dtype
    if _on(cfg) and dtype not in HALF_PRECISION:
        return f"{OVERLAP}=true with precision.params_dtype={dtype}; megatron-core overlaps only bf16/fp16 models"
    return None


@rule(
    "ep_overlap.no_full_recompute",
    [OVERLAP, "train.recompute"],
    "EP communication overlap splits each layer into separately scheduled parts: no full-layer recomputation",
    "set train.recompute=selective (or none)",
)
def _recompute(cfg: RunConfig) -> Optional[str]:
    if _on(cfg) and cfg.train.recompute == "full":
        return (f"{OVERLAP}=true with train.recompute=full (method {cfg.train.recompute_method}); the combined 1F1B "
                "schedule runs a layer's attention, dispatch, experts and combine as separate steps, which a "
                "recomputed layer cannot be; use train.recompute=selective")
    return None


@rule(
    "ep_overlap.pipeline_needs_vpp",
    [OVERLAP, "parallel.pp", "parallel.vpp"],
    "with pipeline parallelism, EP communication overlap runs the interleaved schedule: parallel.vpp is set",
    "set parallel.vpp (>= 2, dividing each rank's layers) or a parallel.pipeline_layout with virtual stages",
)
def _pipeline_needs_vpp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if _on(cfg) and p.pp > 1 and not p.vpp:
        return (f"{OVERLAP}=true with parallel.pp={p.pp} and no virtual stages (parallel.vpp=null); megatron-core "
                "overlaps only inside its interleaved 1F1B schedule")
    return None


@rule(
    "ep_overlap.mtp",
    [OVERLAP, "model.mtp_num_layers", "parallel.pp"],
    "EP communication overlap takes at most one MTP layer, and (megatron-core 0.16-0.17) an MTP layer needs parallel.pp > 1",
    "set model.mtp_num_layers=1 with parallel.pp>1 and parallel.vpp, or overlap off",
)
def _mtp(cfg: RunConfig) -> Optional[str]:
    n, pp = cfg.model.mtp_num_layers, cfg.parallel.pp
    if not _on(cfg) or not n:
        return None
    if n > 1:
        return f"{OVERLAP}=true with model.mtp_num_layers={n}; megatron-core's overlap schedules one MTP layer at most"
    if pp <= 1:
        return (f"{OVERLAP}=true with an MTP layer and parallel.pp={pp}: megatron-core 0.16 and 0.17 refuse it "
                "(0.18 lifts the condition); use parallel.pp>1 with parallel.vpp")
    return None


@rule(
    "ep_overlap.fsdp",
    [OVERLAP, "parallel.fsdp"],
    "EP communication overlap runs with megatron-core's DDP, not Megatron-FSDP",
    "set parallel.fsdp=false (the distributed optimizer shards optimizer state), or overlap off",
)
def _fsdp(cfg: RunConfig) -> Optional[str]:
    if _on(cfg) and cfg.parallel.fsdp:
        return (f"{OVERLAP}=true with parallel.fsdp=true: megatron-core 0.16-0.17's combined 1F1B schedule calls the "
                "model's layers directly, past Megatron-FSDP's forward that gathers their sharded parameters "
                "(0.18 adds the hooks, without virtual stages)")
    return None


@rule(
    "ep_overlap.activation_offload",
    [OVERLAP, "train.activation_offload_layers"],
    "EP communication overlap runs the layers outside TransformerBlock.forward, where layer offloading lives",
    "set train.activation_offload_layers=0 (or overlap off)",
)
def _activation_offload(cfg: RunConfig) -> Optional[str]:
    n = cfg.train.activation_offload_layers
    if _on(cfg) and n > 0:
        return (f"{OVERLAP}=true with train.activation_offload_layers={n}: megatron-core's combined 1F1B schedule calls "
                "each layer's parts itself, outside the block's offloading context, so nothing would be offloaded "
                "and the memory the plan counted on would not be freed (megatron-core does not refuse it)")
    return None


@rule(
    "ep_overlap.delay_wgrad_needs_overlap",
    ["parallel.delay_wgrad_compute", OVERLAP],
    "deferred weight gradients fill the EP overlap: parallel.delay_wgrad_compute needs the overlap on",
    "set parallel.overlap_moe_expert_parallel_comm=true, or parallel.delay_wgrad_compute=false",
)
def _delay_needs_overlap(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.delay_wgrad_compute and not _on(cfg):
        return f"parallel.delay_wgrad_compute=true with {OVERLAP}=false"
    return None


@rule(
    "ep_overlap.device_connections",
    [OVERLAP, "cluster.env"],
    "EP communication overlap needs more than one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS > 1)",
    "remove CUDA_DEVICE_MAX_CONNECTIONS from cluster.env (the job script sets 32 for the overlap)",
)
def _device_connections(cfg: RunConfig) -> Optional[str]:
    value = (cfg.cluster.env or {}).get("CUDA_DEVICE_MAX_CONNECTIONS")
    if _on(cfg) and is_gpu(cfg) and value is not None and str(value).strip() == "1":
        return (f"{OVERLAP}=true with cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue runs the "
                "communication stream's all-to-alls in line with the computation, so nothing is hidden")
    return None


def _te_needed(cfg: RunConfig) -> tuple:
    return TE_DELAY_WGRAD_OVERLAP_GRAD_REDUCE if cfg.parallel.overlap_grad_reduce else TE_DELAY_WGRAD


@rule(
    "machine.delay_wgrad_needs_te",
    ["parallel.delay_wgrad_compute", "parallel.overlap_grad_reduce"],
    "deferred weight gradients are Transformer Engine's (2.7+; 2.8+ with overlap_grad_reduce) on a GPU",
    "set parallel.delay_wgrad_compute=false",
    scope="machine",
)
def _delay_wgrad_te(cfg: RunConfig, host: Host) -> Optional[str]:
    if not cfg.parallel.delay_wgrad_compute:
        return None
    m = host.machine
    need = ".".join(map(str, _te_needed(cfg)))
    if not (m.cuda and m.transformer_engine):
        where = "this machine has no GPU" if not m.cuda else "Transformer Engine is not importable here"
        return (f"parallel.delay_wgrad_compute=true needs Transformer Engine {need}+, but {where}: megatron-core's "
                "own linears compute weight gradients in the backward pass (their backward_dw does nothing), so "
                "nothing would be deferred (Megatron-LM refuses it without TE)")
    have = tuple(getattr(m, "te_version", ()) or ())
    if have < _te_needed(cfg):
        found = ".".join(map(str, have)) if have else "an unreadable version"
        why = (" with parallel.overlap_grad_reduce (Megatron-LM's floor: the overlapped reduction must wait for "
               "the deferred weight gradient)") if cfg.parallel.overlap_grad_reduce else ""
        return f"parallel.delay_wgrad_compute=true needs Transformer Engine {need}+{why}; found {found}"
    return None


EP_OVERLAP_RULES = [
    _needs_ep,
    _dispatcher,
    _precision,
    _recompute,
    _pipeline_needs_vpp,
    _mtp,
    _fsdp,
    _activation_offload,
    _delay_needs_overlap,
    _device_connections,
]
EP_OVERLAP_MACHINE_RULES = [_delay_wgrad_te]
