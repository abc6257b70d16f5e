"""What the step-time model assumes a GPU sustains, and how far to trust the result.

Hardware figures (peak FLOP/s per precision, HBM and link bandwidths, HBM size) are data in the cluster
groups (``recipes/cluster/*.yaml``, each with its source). This module holds the *efficiencies*: the share
of those peaks that megatron-core's kernels reach. Each constant says where it comes from:

* ``measured``   a measurement quoted in the docstring
* ``calibrated`` fitted to the published DGX-H100 rows of Megatron-Bridge's "Performance Summary for
                 Large Language Models" (``tests/data/published_throughput.csv``; only the H100 rows
                 were used, every other system is a check of the model, not an input to it)
* ``assumed``    a round figure nothing here has measured; the plan says so when it matters
"""

from __future__ import annotations

from megatron_recipes.config.schema import RunConfig

# --- matmuls -------------------------------------------------------------------------------------
# Share of the dense tensor-core peak a large GEMM sustains, per number format.
GEMM_EFFICIENCY = {
    # measured: an 8192^3 bf16 matmul on an H200 ran at about 790 of 989 TFLOP/s
    "bf16": 0.80,
    # calibrated (H100 FP8 rows: Llama3-70B at 1.05x, Llama3.1-405B at 1.03x of the published figure):
    # per-tensor current/delayed scaling, the amax and cast kernels around each GEMM folded in
    "fp8": 0.60,
    # assumed: block-scaled formats (blockwise FP8, MXFP8, NVFP4) at the FP8 figure less the scale
    # handling; no H100 row can calibrate them (Hopper has no MXFP8/NVFP4 tensor cores)
    "fp8_block": 0.55,
    "fp4": 0.45,
}
# assumed: a GEMM whose smallest dimension is ``d`` reaches d / (d + GEMM_HALF_DIM) of the large-GEMM
# figure (tile quantisation and launch overhead of thin GEMMs, e.g. MoE experts with few tokens each)
GEMM_HALF_DIM = 128
# assumed: fused (flash) attention, forward + backward, in bf16 on Hopper/Blackwell (cuDNN via TE)
ATTENTION_EFFICIENCY = 0.50

# --- memory-bound kernels ------------------------------------------------------------------------
# assumed: norms, RoPE, SwiGLU, residual adds, FP8 casts, MoE permutation and router kernels move
# about MEMORY_PASSES x the bytes a layer saves for backward, at HBM bandwidth (forward + backward)
MEMORY_PASSES = 6.0
HBM_EFFICIENCY = 0.75  # assumed: achievable share of the HBM datasheet bandwidth for streaming kernels

# --- communication -------------------------------------------------------------------------------
LINK_EFFICIENCY = 0.80  # assumed: NCCL bus bandwidth / link datasheet bandwidth for large collectives
# calibrated (Qwen3-30B-A3B H100 row, 1.04x when fitted): achieved share of the link for a blocking MoE
# token exchange. One MoE row fixes it, so besides the transfer it absorbs the time ranks wait for each other
# at every exchange and MoE kernel overheads the memory term misses. Overlapped exchanges
# (overlap_moe_expert_parallel_comm) put the transfer alone on the communication stream, at LINK_EFFICIENCY,
# the other micro-batch's computation filling the waiting (moe_comm.py): the overlapped published runs
# (Qwen3-235B-A22B H100, DeepSeek-V3 B200) could not reach their step times were their transfers this slow
ALL_TO_ALL_EFFICIENCY = 0.25
# assumed: share of TP all-gather/reduce-scatter time left exposed. The published recipes overlap TP
# communication with GEMMs (Transformer Engine userbuffers, tp_comm_overlap); megatron-recipes' trainer
# does not enable it yet, so our runs expose it all (the plan prints that figure too).
TP_EXPOSED = 0.25
# assumed: CP p2p exchanges overlap with the attention of the previous chunk; what exceeds it is exposed
CP_P2P_OVERLAP = 1.0
# assumed: under CP, Transformer Engine runs attention as 2 x cp sub-blocks per rank and merges their
# partial outputs and log-sum-exps in fp32: the attention kernels reach this share of their plain rate
CP_ATTENTION_FACTOR = 0.5
# assumed: pipeline sends/receives under the interleaved schedule overlap with compute (megatron-core's
# overlap_p2p_comm, which the trainer enables with vpp on GPUs); without interleaving they are exposed
PP_EXPOSED_INTERLEAVED = 0.0

# --- CPU clusters (no peak given): nominal rates, for ranking layouts only ------------------------
NOMINAL_TFLOPS = 1.0
NOMINAL_BW_GBPS = 10.0

# --- how far to trust the figure -----------------------------------------------------------------
# calibrated: the largest |estimate / published - 1| over the three calibration rows was 0.05 when fitted
# (0.08 now: Qwen3-30B-A3B's MoE activations no longer count a tensor megatron-core does not keep); 0.15
# leaves room for layouts unlike them (the Qwen3-235B-A22B H100 row, a check, is at 0.13)
CALIBRATED_SPREAD = 0.15
UNCALIBRATED_FORMAT_SPREAD = 0.30  # assumed: a number format no H100 row calibrates (MXFP8, NVFP4, bf16)
UNCALIBRATED_SYSTEM_SPREAD = 0.30  # assumed: a GPU generation other than Hopper
MOE_SPREAD = 0.10  # assumed: extra for MoE (dispatch kernels, expert load)


def gemm_format(cfg: RunConfig) -> str:
    """The number format the transformer layers' linear GEMMs run in."""
    p = cfg.precision
    if p.fp4:
        return "fp4"
    if p.fp8:
        return "fp8_block" if p.fp8_recipe in ("blockwise", "mxfp8") else "fp8"
    return "bf16"


def peak_tflops(cfg: RunConfig, fmt: str) -> float:
    """Dense peak of the cluster's GPU in ``fmt`` (0 if the cluster gives no such figure)."""
    c = cfg.cluster
    if fmt == "fp4":
        return c.peak_fp4_tflops
    if fmt.startswith("fp8"):
        return c.peak_fp8_tflops
    return c.peak_bf16_tflops


def gemm_size_factor(smallest_dim: float) -> float:
    return smallest_dim / (smallest_dim + GEMM_HALF_DIM) if smallest_dim > 0 else 1.0


def spread(cfg: RunConfig) -> tuple[float, list[str]]:
    """Relative uncertainty of the throughput estimate and why."""
    why = []
    s = CALIBRATED_SPREAD
    fmt = gemm_format(cfg)
    if fmt != "fp8" or cfg.precision.fp8_recipe not in ("tensorwise", "delayed"):
        s += UNCALIBRATED_FORMAT_SPREAD
        why.append(f"{fmt} GEMM efficiency is assumed, not calibrated")
    if cfg.cluster.gpu_arch != "hopper":
        s += UNCALIBRATED_SYSTEM_SPREAD
        why.append(f"{cfg.cluster.gpu_arch} efficiencies are assumed equal to Hopper's")
    if cfg.model.num_moe_experts:
        s += MOE_SPREAD
        why.append("MoE dispatch is calibrated on one run with force-balanced experts")
    return s, why
