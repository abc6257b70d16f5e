"""Typed recipe schema: every key a recipe may set, with its type.

These dataclasses are registered with Hydra's ConfigStore, so a recipe YAML that sets an unknown key or
a value of the wrong type fails at composition time. Required fields use ``MISSING`` (no ``None``
default); ``Optional`` fields mean "not used" when ``None``. Nothing below ``config/`` reads OmegaConf:
everything takes a ``RunConfig`` instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# Allowed values of the string-valued fields, defined once: the rule table checks recipes against them and
# the builders (optimizer, transformer config, Slurm script) map exactly these.
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu", "squared_relu")
POSITION_TYPES = ("rope", "learned_absolute", "none")
ROPE_SCALING_TYPES = ("llama3", "yarn")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# train.recompute_modules (with train.recompute=selective): megatron-core's recompute_modules, 0.16 to 0.19
# (0.19's gdn_norm_out recomputes a GatedDeltaNet norm, which no family here has); runtime/mcore_compat.py
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
OPTIMIZERS = ("adam", "sgd")
DECAY_STYLES = ("cosine", "linear", "constant")
LAUNCHERS = ("torchrun", "pmix")
# how a job asks Slurm for GPUs: --gpus-per-node (cons_tres), or --gres=gpu:N (clusters without cons_tres)
GPU_REQUESTS = ("gpus-per-node", "gres")
# which field takes which of them (shell completion offers these; the rules check the same fields)
FIELD_VALUES = {
    "model.normalization": NORMALIZATIONS, "model.activation": ACTIVATIONS,
    "model.position_embedding_type": POSITION_TYPES, "model.rope_scaling.rope_type": ROPE_SCALING_TYPES,
    "train.recompute": RECOMPUTE, "train.recompute_method": RECOMPUTE_METHODS, "optimizer.name": OPTIMIZERS,
    "optimizer.lr_decay_style": DECAY_STYLES, "cluster.launcher": LAUNCHERS, "cluster.gpu_request": GPU_REQUESTS,
}


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling as in HF ``rope_scaling``: ``llama3`` (Llama 3.1) or ``yarn`` (DeepSeek-V3)."""

    rope_type: str = "llama3"  # llama3 | yarn
    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn
    mscale_all_dim: float = 0.0  # yarn


@dataclass
class ModelConfig:
    """Architecture only, as published. Counts use a ``num_`` prefix like megatron-core."""

    name: str = MISSING
    family: str = MISSING  # llama | mistral | qwen2 | qwen3 | mixtral | qwen3_moe | deepseek_v3
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING  # == num_attention_heads for plain multi-head attention
    ffn_hidden_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    kv_channels: Optional[int] = None  # head dim; None -> hidden_size // num_attention_heads
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"  # swiglu | gelu | squared_relu
    position_embedding_type: str = "rope"  # rope | learned_absolute | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: Optional[RopeScalingConfig] = None
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    sliding_window: Optional[int] = None  # attend to the last N tokens (Mistral); None = full causal attention
    # Mixture of experts (num_moe_experts None -> dense model)
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_first_dense_layers: int = 0  # DeepSeek-V3 keeps its first layers dense
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    # Multi-latent attention (DeepSeek)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    mtp_num_layers: Optional[int] = None
    # weight of the multi-token-prediction loss beside the main one (megatron-core's mtp_loss_scaling_factor,
    # its default 0.1; split evenly over the MTP layers). A training setting, not part of the weights.
    mtp_loss_scaling_factor: float = 0.1


@dataclass
class ParallelConfig:
    """Parallel degrees. DP is derived: world / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None -> same as tp (megatron-core default)
    sp: bool = False
    cp_comm_type: str = "p2p"  # p2p | all_gather | a2a | a2a+p2p
    cp_hierarchical_sizes: Optional[List[int]] = None  # a2a+p2p only: CP group levels, product = cp (a2a on the first)
    moe_dispatcher: str = "alltoall"  # allgather | alltoall | flex
    moe_flex_backend: str = "deepep"  # deepep | hybridep (only with moe_dispatcher=flex)
    # hide the expert-parallel all-to-all behind another micro-batch's computation (megatron-core's
    # overlap_moe_expert_parallel_comm, the combined 1F1B schedule) and defer weight gradients to fill it
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # count the embedding / the loss as one layer each when splitting the pipeline (megatron-core's
    # account_for_*_in_pipeline_split): 126 layers + 2 = 128 = pp8 x vpp8 x 2 for Llama 3.1 405B
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # megatron-core's pipeline_model_parallel_layout: which stage holds the embedding, each decoder layer, the
    # MTP layers and the loss, e.g. "Et|(tt|)*30mL" (config/pipeline_layout.py); replaces the split fields above
    pipeline_layout: Optional[str] = None
    allow_inter_node_tp: bool = False  # TP groups leaving the NVLink domain are an error unless set
    allow_inter_node_ep: bool = False  # EP groups leaving the NVLink domain are an error unless set
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # ZeRO stage of data-parallel sharding (with optimizer.use_distributed_optimizer=true):
    # zero1 optimizer state | zero2 + gradients | zero3 + parameters (FSDP's FULL_SHARD).
    # zero2/zero3 run through Megatron-FSDP (parallel.fsdp=true); see estimate/sharding.py.
    sharding: str = "zero1"  # zero1 | zero2 | zero3
    fsdp: bool = False  # data parallelism through megatron-core's Megatron-FSDP instead of its DDP
    # Hybrid sharding (HSDP / ZeRO++ hpZ-like): shard inside DP / instances ranks, replicate across
    dist_optimizer_instances: int = 1


@dataclass
class ClusterConfig:
    """Hardware and the scheduler/container settings that launch needs."""

    name: str = MISSING
    nodes: int = 1
    gpus_per_node: int = MISSING  # ranks per node (CPU processes on the CPU lane)
    nvlink_domain: int = MISSING  # GPUs reachable over NVLink; == gpus_per_node on HGX, 72 on NVL72
    gpu_memory_gb: float = MISSING
    host_memory_gb: float = 0.0  # RAM per node for offloaded optimizer state; 0 = unknown (offload refused)
    gpu_arch: str = MISSING  # cpu | ampere | hopper | blackwell
    peak_bf16_tflops: float = 0.0  # dense, per GPU; 0 on CPU (MFU reported as n/a)
    peak_fp8_tflops: float = 0.0  # dense, per GPU; 0: the GPU has no FP8 tensor cores
    peak_fp4_tflops: float = 0.0  # dense, per GPU; 0: the GPU has no FP4 tensor cores
    hbm_bw_gbps: float = 0.0  # GB/s per GPU, HBM (memory-bound kernels); 0 on CPU
    intra_node_bw_gbps: float = 0.0  # GB/s per GPU, NVLink, one direction
    inter_node_bw_gbps: float = 0.0  # GB/s per GPU, network, one direction
    # Scheduler / container (used by `megatron-recipes slurm`)
    account: Optional[str] = None
    partition: Optional[str] = None
    require_account: bool = False
    time_limit: str = "04:00:00"
    cpus_per_task: Optional[int] = None  # CPUs of one node: torchrun's task gets all, pmix splits them per rank
    # sbatch --mem (memory per node): "0" = all of each node's memory, as a job with the whole node expects
    # (a site's DefMemPerCPU would otherwise cap it: offloaded optimizer state then cannot fit); a size
    # such as "1500G"; null leaves it to the site's defaults (and allows --mem-per-cpu/--mem-per-gpu extras)
    mem: Optional[str] = "0"
    exclusive: bool = True
    container_image: Optional[str] = None
    container_mounts: List[str] = field(default_factory=list)
    container_workdir: Optional[str] = None
    launcher: str = "torchrun"  # torchrun (one task per node) | pmix (one task per GPU)
    gpu_request: str = "gpus-per-node"  # gpus-per-node | gres (sbatch/srun --gres=gpu:N, without cons_tres)
    sbatch_extra: List[str] = field(default_factory=list)
    srun_extra: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    preempt_signal: str = "USR1"
    preempt_signal_lead_s: int = 300
    max_restarts: int = 3


@dataclass
class PrecisionConfig:
    name: str = MISSING
    params_dtype: str = "bf16"  # fp32 | bf16 | fp16
    fp8: Optional[str] = None  # None | e4m3 | hybrid
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    fp8_param_gather: bool = False
    fp4: Optional[str] = None  # None | nvfp4
    grad_reduce_in_fp32: bool = True


@dataclass
class DataConfig:
    """Where tokens come from. ``builtin`` builds a corpus from local Python sources (no downloads)."""

    kind: str = MISSING  # builtin | indexed | sft | mock
    tokenizer: str = "builtin"  # local HF tokenizer directory, or "builtin"
    blend: List[Any] = field(default_factory=list)  # [weight, prefix, weight, prefix, ...] or [prefix]
    # {"train": [...], "valid": [...], "test": [...]}; empty = unused (a dict, not None, so CLI overrides merge)
    blend_per_split: Dict[str, List[Any]] = field(default_factory=dict)
    split: str = "949,50,1"
    cache_dir: Optional[str] = None  # index caches; a shared filesystem path on multi-node jobs
    num_workers: int = 0
    builtin_max_files: int = 600  # builtin corpus: how many stdlib files to read
    builtin_vocab_size: int = 4096
    # SFT
    sft_path: Optional[str] = None  # a JSONL file, or "builtin": the generated chat set with checkable answers
    sft_valid_path: Optional[str] = None
    chat_template: Optional[str] = None  # None -> the tokenizer's own; or a template shipped with the project
    answer_only_loss: bool = True
    packing: bool = True
    overlong_policy: str = "truncate"  # truncate | drop


@dataclass
class OptimizerConfig:
    name: str = "adam"  # adam | sgd
    lr: float = MISSING
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0
    # Warm-up length: absolute steps when set (wins), else a fraction of the decay horizon (Megatron-LM's
    # --lr-warmup-fraction), so a shorter train.train_iters needs no second override.
    lr_warmup_iters: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    lr_decay_iters: Optional[int] = None  # None -> train.train_iters
    use_distributed_optimizer: bool = True
    # Optimizer state and step on the host (DeepSpeed's offload_optimizer): megatron-core's
    # HybridDeviceOptimizer; offload_fraction of the (sharded) state moves, the rest stays on the GPU.
    cpu_offload: bool = False
    offload_fraction: float = 1.0


@dataclass
class CheckpointConfig:
    save_interval: int = 1000
    keep_last: int = 2
    load: str = "auto"  # auto (latest complete under run.dir/checkpoints) | none | <path>
    pretrained: Optional[str] = None  # converted base model to start from (fine-tuning)
    save: bool = True
    # Distributed-optimizer state on disk: fully_reshardable resumes in any TP/PP/VPP/DP/EP layout;
    # dp_reshardable saves without gathering but resumes only with the same model-parallel layout.
    # auto: dp_reshardable when the fully_reshardable gather is large (estimate/checkpoint_cost.py), else
    # fully_reshardable, and fully_reshardable after a resume that changed the layout (the log says which).
    optimizer_format: str = "auto"
    # Write in the background (megatron-core's async torch_dist save); the loop blocks only to stage the
    # tensors. null: on with CUDA, off on the CPU lane (its tiny saves take less than forking the writer).
    async_save: Optional[bool] = None
    # Loading unpickles only what a checkpoint needs (tensors, plain values, the index records); true lifts
    # that for checkpoints you made or trust, whose pickled objects may then run code (SECURITY.md).
    trust_code: bool = False
    # A resume refuses other data than the checkpoint's (its consumed_samples would index other samples);
    # true accepts it for a new data phase that keeps the optimizer state (the log says so).
    accept_new_data: bool = False


@dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    tensorboard: bool = True  # when the tensorboard package is importable
    wandb_project: Optional[str] = None  # W&B; WANDB_MODE=offline keeps the run on disk
    wandb_entity: Optional[str] = None
    mlflow_tracking_uri: Optional[str] = None  # http(s)://..., file:..., sqlite:///...
    mlflow_experiment: Optional[str] = None  # None: run.name
    tracking_run_name: Optional[str] = None  # the run's name in W&B/MLflow; None: run.name
    tags: List[str] = field(default_factory=list)  # W&B tags; MLflow tags (value "true")
    plot: bool = True


@dataclass
class FusionsConfig:
    """megatron-core's fused GPU kernels: null = on where this machine has the kernel (off on the CPU
    lane), true = required (an error where missing), false = off. See models/fusions.py."""

    gradient_accumulation: Optional[bool] = None
    rope: Optional[bool] = None
    bias_dropout: Optional[bool] = None
    bias_activation: Optional[bool] = None
    moe_permute: Optional[bool] = None
    moe_router: Optional[bool] = None


@dataclass
class TrainConfig:
    global_batch_size: int = MISSING
    micro_batch_size: int = MISSING
    seq_length: int = MISSING
    train_iters: int = MISSING
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"  # uniform | block (with recompute=full)
    recompute_num_layers: int = 1
    # with recompute=selective: the submodules whose activations are dropped and rebuilt in backward
    # (megatron-core's recompute_modules, schema.RECOMPUTE_MODULES; its default: core attention alone)
    recompute_modules: List[str] = field(default_factory=lambda: ["core_attn"])
    exit_on_nan: bool = True
    # Layer-level activation offloading to host memory (megatron-core ``cpu_offloading``, Transformer
    # Engine only): activations of this many transformer layers per stage go to the host. 0 = off.
    activation_offload_layers: int = 0
    # Stop cleanly (checkpoint first) once the step count is a multiple of this (Megatron-LM's
    # --exit-interval): for jobs split into fixed chunks of steps. None = run to train_iters.
    exit_interval: Optional[int] = None
    # megatron-core's deterministic_mode (bit-for-bit repeatable runs, slower): the embedding backward
    # without atomics, and Transformer Engine's attention refuses to start unless the environment has
    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Megatron-LM --deterministic-mode also wants NCCL_ALGO set and
    # torch.use_deterministic_algorithms; benchmarks/gpu_check.py sets all three around the trainer).
    deterministic: bool = False
    fusions: FusionsConfig = field(default_factory=FusionsConfig)


@dataclass
class RunDirConfig:
    dir: str = MISSING
    name: str = "run"


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning. ``method: none`` trains every parameter (pretraining, full SFT).

    ``method`` is one of none | lora | dora | qlora | ptuning, or ``qlora+dora`` (DoRA on an NF4 base).
    """

    method: str = "none"
    # LoRA / DoRA / QLoRA adapters on megatron-core's parallel linears
    rank: int = 16
    alpha: float = 32.0  # scaling = alpha / rank, as in HF PEFT
    dropout: float = 0.0  # on the adapter's input
    target_modules: List[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )  # also expert_fc1 / expert_fc2 (routed experts); shared experts count as linear_fc1/fc2
    # base modules trained whole beside the adapters and saved with them (HF PEFT's modules_to_save):
    # output_layer (the LM head) lets a small base raise tokens its frozen head cannot make likely
    modules_to_save: List[str] = field(default_factory=list)
    # QLoRA: frozen base linears stored as NF4 with double-quantised scales
    nf4_block_size: int = 64
    double_quant: bool = True
    double_quant_block_size: int = 256
    nf4_backend: str = "auto"  # auto (bitsandbytes on a GPU when importable, else torch) | torch | bnb
    # P-Tuning v2: trainable per-layer prefix keys/values
    prefix_length: int = 16
    prefix_projection: bool = False  # reparameterise the prefixes through a per-layer MLP
    prefix_projection_hidden: int = 512


@dataclass
class RunConfig:
    """A whole, resolved recipe."""

    run: RunDirConfig = field(default_factory=RunDirConfig)
    seed: int = 1234
    model: ModelConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = MISSING
    precision: PrecisionConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
