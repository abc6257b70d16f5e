"""NCCL/CUDA/torch environment for a job, chosen from the hardware and the layout, each with its reason.

The reasons are rendered as comments above each ``export`` in the sbatch script, because these are the
rules nobody remembers (field notes: CUDA_DEVICE_MAX_CONNECTIONS, silent NCCL fallbacks, hangs that do
not say which rank). ``cluster.env`` is applied last and wins over every default here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_recipes.config.schema import RunConfig


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    why: str
    expand: bool = False  # the value refers to script variables ("$JOB_LOG_DIR/...") and is double-quoted


def cuda_device_max_connections(cfg: RunConfig) -> List[EnvVar]:
    """Also applied by every rank of a single-node start (training/cli.py), which has no job script."""
    p, arch = cfg.parallel, cfg.cluster.gpu_arch
    if p.fsdp and arch != "cpu":
        return [EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS", "8",
            "parallel.fsdp: Megatron-FSDP overlaps parameter all-gathers and gradient reduce-scatters with compute "
            "on several hardware queues, which a single queue would serialise (Megatron-LM refuses FSDP with 1); "
            "8 is CUDA's default, set explicitly so a container's 1 cannot leak in",
        )]
    if p.overlap_moe_expert_parallel_comm and arch != "cpu":
        ordered = (p.tp > 1 or p.cp > 1) and arch in ("hopper", "ampere")
        tp_note = (f"; with tp={p.tp}, cp={p.cp} on {arch} the TP/CP kernels lose their single-queue ordering "
                   "(Megatron-LM warns and lets the overlap win)") if ordered else ""
        return [EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS", "32",
            "parallel.overlap_moe_expert_parallel_comm: the expert all-to-alls run on their own stream beside "
            "another micro-batch's computation, which one hardware queue would serialise (megatron-core's MoE "
            f"guide: more than 1){tp_note}",
        )]
    if p.tp == 1 and p.cp == 1:
        return []
    if arch in ("hopper", "ampere"):
        return [EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS", "1",
            f"tp={p.tp}, cp={p.cp} on {arch}: megatron-core overlaps TP/CP communication with compute by relying "
            "on kernels being issued in program order through a single hardware queue; required before Blackwell "
            "(an FSDP run would need more than one queue instead)",
        )]
    if arch == "blackwell":
        return [EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS", "32",
            f"tp={p.tp}, cp={p.cp} on blackwell: ordering no longer needs a single queue; more queues let "
            "DP/PP communication kernels run next to the TP/CP ones",
        )]
    return []


def derive_env(cfg: RunConfig) -> List[EnvVar]:
    """The defaults for this recipe, in a fixed order (so rendered scripts are stable)."""
    c, p = cfg.cluster, cfg.parallel
    env = [
        EnvVar("PYTHONUNBUFFERED", "1", "logs appear as they happen, so a hung job's log shows its last step"),
        EnvVar("LOGLEVEL", "INFO", "torchrun logs each node's rendezvous result (group rank, world size, master)"),
    ]
    if c.gpu_arch == "cpu":
        if c.cpus_per_task:
            threads = max(1, c.cpus_per_task // c.gpus_per_node)
            env.append(EnvVar(
                "OMP_NUM_THREADS", str(threads),
                f"CPU lane: {c.gpus_per_node} rank(s) per node share cluster.cpus_per_task={c.cpus_per_task} CPUs; "
                "without it every rank starts one thread per core of the node",
            ))
        return env
    env += cuda_device_max_connections(cfg)
    if p.overlap_grad_reduce or p.overlap_param_gather:
        env.append(EnvVar("NVTE_FWD_LAYERNORM_SM_MARGIN", "16",
                          "DP communication is overlapped with compute: leave SMs free for it during TE norms"))
        env.append(EnvVar("NVTE_BWD_LAYERNORM_SM_MARGIN", "16", "the same for the backward norms"))
    if c.nvlink_domain > c.gpus_per_node:
        env.append(EnvVar(
            "NCCL_MNNVL_ENABLE", "1",
            f"the NVLink domain ({c.nvlink_domain} GPUs) spans nodes of {c.gpus_per_node}: use multi-node NVLink "
            "or fail at start-up, rather than silently sending TP/EP traffic over the network",
        ))
    env += [
        EnvVar("NCCL_DEBUG", "WARN", "NCCL explains its errors in the log without the INFO flood"),
        EnvVar("TORCH_NCCL_AVOID_RECORD_STREAMS", "1",
               "communication buffers are freed in stream order instead of through record_stream: lower peak memory"),
        EnvVar("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000",
               "keep the last collectives of every rank (flight recorder) to dump when a collective times out"),
        EnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", "1",
               "on an NCCL timeout every rank writes what it was waiting for: the hang names its rank"),
        EnvVar("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "$JOB_RUN_DIR/slurm/$SLURM_JOB_ID/nccl_trace_rank_",
               "where those per-rank dumps go: next to this job's logs (the path as the ranks see it)", expand=True),
    ]
    return env


def user_env(cfg: RunConfig) -> List[EnvVar]:
    return [EnvVar(k, str(v), "from cluster.env (overrides the defaults above)") for k, v in cfg.cluster.env.items()]
