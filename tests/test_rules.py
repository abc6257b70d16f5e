"""Every validation rule has a recipe that breaks it and a nearby recipe that passes every rule.

Cases are composed through Hydra (the way users write them), validated with the recipe and input rules
plus the rules of the case's own scope (a launch case is judged as `slurm` would judge it), and checked by
rule id. A rule added to the table without a case here fails ``test_every_rule_has_a_case``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import ValidationError
from megatron_recipes.models.capabilities import Machine
from megatron_recipes.validation.rules import RULES, Host, rules_by_id, select
from megatron_recipes.validation.validate import validate, validate_or_raise

TINY = "tiny_llama_cpu"  # CPU lane, TP2 over 2 ranks, fp32, built-in data
MOE = ("model=tiny_moe", "parallel=none")  # on TINY: 4 experts top-2 over 2 ranks
L70 = "llama3_70b_pretrain"  # 8 H100 nodes, TP4 PP4 VPP5 CP2
L70_SFT = "llama3_70b_sft"  # 4 H100 nodes, TP4 PP4, packed SFT data
MIX = "mixtral_8x7b_pretrain"  # 8 H100 nodes, PP4 VPP8 EP8
DSV3 = "deepseek_v3_pretrain"  # 128 H100 nodes, TP2 PP16 EP64 (inter-node, allowed)
PT = "checkpoint.pretrained=base_ckpt"  # PEFT needs a base checkpoint
GB200 = ("cluster=gb200_nvl72", "cluster.nodes=16")
PP2 = ("parallel.tp=1", "parallel.pp=2")
FS = ("parallel=none", "parallel.fsdp=true", "checkpoint.save=false", "checkpoint.load=none")  # FSDP over DP=2
FP8_FSDP = (*FS, "precision=fp8_delayed", "precision.fp8_param_gather=true")  # on L8: FP8 weights under Megatron-FSDP
F70 = "llama3_70b_sft_fsdp"  # 2 H100 nodes, Megatron-FSDP zero3 + optimizer offload
SFT = ("data.sft_path=train.jsonl", PT)
L8 = "llama3_8b_pretrain"  # 1 H100 node, TP2 CP2, no recompute
IMAGE = ("cluster.container_image='team/trainer:1.0'", "run.dir=/runs/x")  # a registry image: nothing to find here
MOUNTED = IMAGE + ("cluster.container_mounts=['/runs']",)
HERE = Path(__file__).resolve().parent  # an existing folder, so its top-level folder is judged on this host
# Machines a machine-rule case runs on (bad side, good side); other cases are judged on CPU.
CPU = Machine(cuda=False, transformer_engine=False, deep_ep=False, compute_capability=(0, 0))
H100 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0))
H100_NO_TE = Machine(cuda=True, transformer_engine=False, deep_ep=False, compute_capability=(9, 0))
H100_DEEP_EP = Machine(cuda=True, transformer_engine=True, deep_ep=True, compute_capability=(9, 0))
A100 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(8, 0))
B200 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(10, 0))
PACKED = ("data.kind=sft", "data.sft_path=builtin", "data.packing=true", PT)
# EP communication overlap on the tiny MoE: EP2 over 2 ranks, bf16; and over PP2 x VPP2 (4 ranks)
OV = ("model=tiny_moe", "parallel=none", "parallel.ep=2", "precision=bf16", "parallel.overlap_moe_expert_parallel_comm=true")
OV_PP = ("parallel.pp=2", "cluster.gpus_per_node=4", "cluster.nvlink_domain=4", "train.micro_batch_size=1")
OV_VPP = (*OV_PP, "parallel.vpp=2")
DELAY = ("parallel.overlap_moe_expert_parallel_comm=true", "parallel.delay_wgrad_compute=true")
SEL = "train.recompute=selective"  # with train.recompute_modules
H100_TE29 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0), te_version=(2, 9))
H100_TE27 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0), te_version=(2, 7))

Case = tuple  # recipe, failing overrides, passing overrides[, (machine failing, machine passing)]

CASES: Dict[str, Case] = {
    "text.control_characters": (TINY, ("run.name='a\nb'",), ("run.name='a b $(x)'",)),
    "values.finite": (TINY, ("optimizer.lr=inf",), ("optimizer.lr=1e-3",)),
    "model.sizes_positive": (TINY, ("model.hidden_size=0",), ("model.hidden_size=512",)),
    "model.family": (TINY, ("model.family=gpt9",), ("model.family=qwen2",)),
    "layout.degrees_positive": (TINY, ("parallel.tp=0",), ()),
    "layout.world_factorisation": (TINY, ("cluster.gpus_per_node=3",), ()),
    "layout.world_bounded": (TINY, ("cluster.nodes=1048576",), ("cluster.nodes=2",)),
    "layout.expert_factorisation": (TINY, MOE + ("parallel.ep=4",), MOE + ("parallel.ep=2",)),
    "tp.attention_heads": (TINY, ("parallel.tp=3", "cluster.gpus_per_node=3", "train.global_batch_size=24"), ()),
    "tp.query_groups": (TINY, ("parallel.tp=4", "cluster.gpus_per_node=4", "train.global_batch_size=32"), ()),
    "tp.ffn_hidden": (TINY, ("model.ffn_hidden_size=385",), ("model.ffn_hidden_size=386",)),
    "tp.nvlink_domain": (L70, ("parallel.tp=16",), ()),
    "sp.needs_tp": (TINY, ("parallel.tp=1", "parallel.sp=true"), ("parallel.sp=true",)),
    "sp.sequence_divisible": (TINY, ("parallel.sp=true", "train.seq_length=129"), ("parallel.sp=true", "train.seq_length=130")),
    "pp.layer_split": (TINY, PP2 + ("parallel.vpp=4",), PP2 + ("parallel.vpp=2",)),
    "pp.pipeline_layout": (TINY, PP2 + ("parallel.pipeline_layout='Ett||ttL'",), PP2 + ("parallel.pipeline_layout='Ett|ttL'",)),
    "pp.vpp_value": (TINY, ("parallel.vpp=2",), PP2 + ("parallel.vpp=2",)),
    "pp.interleaved_microbatches": (TINY, PP2 + ("parallel.vpp=2", "train.global_batch_size=24"), PP2 + ("parallel.vpp=2", "train.global_batch_size=32")),
    "pp.pipeline_fill": (TINY, PP2 + ("train.global_batch_size=8",), PP2),
    "cp.sequence_divisible": (L70, ("train.seq_length=8190",), ("train.seq_length=8184",)),
    "cp.comm_type": (TINY, ("parallel.cp_comm_type=ring",), ("parallel.cp_comm_type=a2a",)),
    "cp.a2a_heads": (L70, ("parallel.cp_comm_type=a2a", "parallel.tp=8", "parallel.cp=4", "parallel.pp=2"), ("parallel.cp_comm_type=a2a",)),
    "cp.hierarchical_sizes": (
        L70,
        ("parallel.cp_comm_type=a2a+p2p",),
        ("parallel.cp_comm_type=a2a+p2p", "parallel.cp=4", "cluster.nodes=16", "parallel.cp_hierarchical_sizes=[2,2]"),
    ),
    "cp.local_attention_all_gather": (TINY, ("parallel.tp=1", "parallel.cp=2"), ("parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=all_gather")),
    "cp.packing_te": (L70_SFT, ("data.sft_path=train.jsonl", PT, "parallel.cp=2"), ("data.sft_path=train.jsonl", PT, "parallel.cp=2", "data.packing=false")),
    "cluster.nvlink_domain_shape": (TINY, ("cluster.nvlink_domain=3",), ("cluster.nvlink_domain=4",)),
    "model.query_groups_divide_heads": (TINY, ("model.num_query_groups=3",), ("model.num_query_groups=4",)),
    "model.head_dim": (
        TINY,
        ("parallel=none", "model.num_attention_heads=6", "model.num_query_groups=6"),
        ("parallel=none", "model.num_attention_heads=6", "model.num_query_groups=6", "model.kv_channels=16"),
    ),
    "model.sequence_within_context": (TINY, ("train.seq_length=1024",), ("train.seq_length=512",)),
    "model.option_values": (TINY, ("model.activation=relu",), ("model.activation=gelu",)),
    "model.rope_settings": (TINY, ("model.rotary_percent=1.5",), ("model.rotary_percent=0.5",)),
    "model.rope_scaling_mcore": ("llama31_405b_pretrain", ("model.rope_scaling.low_freq_factor=2.0",), ("model.rope_scaling.factor=16.0",)),
    "vocab.padding": (TINY, ("model.make_vocab_size_divisible_by=12",), ("model.make_vocab_size_divisible_by=64",)),
    "vocab.builtin_tokenizer_fits": (TINY, ("data.builtin_vocab_size=8192",), ("data.builtin_vocab_size=2048",)),
    "mla.fields": (DSV3, ("model.kv_lora_rank=null",), ()),
    "mla.rope": (DSV3, ("model.position_embedding_type=none",), ()),
    "mla.no_qkv_bias": (DSV3, ("model.add_qkv_bias=true",), ()),
    "mla.latent_norms": (DSV3, ("model.qk_layernorm=false",), ()),
    "model.mtp_loss_scaling_factor": (DSV3, ("model.mtp_loss_scaling_factor=-0.3",), ("model.mtp_loss_scaling_factor=0.1",)),
    "moe.ep_needs_experts": (TINY, ("parallel.tp=1", "parallel.ep=2"), MOE + ("parallel.ep=2",)),
    "moe.settings_need_experts": (TINY, ("model.moe_ffn_hidden_size=256",), MOE),
    "moe.experts_divisible_by_ep": (MIX, ("parallel.ep=16",), ()),
    "moe.router_topk": (TINY, MOE + ("model.moe_router_topk=5",), MOE + ("model.moe_router_topk=4",)),
    "moe.group_routing": (
        TINY,
        MOE + ("model.moe_router_num_groups=3", "model.moe_router_group_topk=1"),
        MOE + ("model.moe_router_num_groups=2", "model.moe_router_group_topk=1"),
    ),
    "moe.router_options": (
        TINY,
        MOE + ("model.moe_router_enable_expert_bias=true",),
        MOE + ("model.moe_router_enable_expert_bias=true", "model.moe_router_score_function=sigmoid"),
    ),
    "moe.global_aux_loss_layout": (TINY, MOE + ("model.moe_router_load_balancing_type=global_aux_loss",),  # DP=2
                                   MOE + ("model.moe_router_load_balancing_type=global_aux_loss", "parallel.tp=2",
                                          "parallel.sp=true")),  # DP=1
    "moe.first_dense_layers": (TINY, MOE + ("model.moe_first_dense_layers=4",), MOE + ("model.moe_first_dense_layers=1",)),
    "moe.tp_needs_sp": (TINY, MOE + ("parallel.tp=2",), MOE + ("parallel.tp=2", "parallel.sp=true")),
    "etp.expert_ffn": (TINY, MOE + ("parallel.etp=3", "cluster.gpus_per_node=3", "train.global_batch_size=24"), MOE + ("parallel.etp=2",)),
    "etp.bias_needs_etp1": (
        TINY,
        MOE + ("model.add_bias_linear=true", "parallel.tp=2", "parallel.sp=true"),
        MOE + ("model.add_bias_linear=true", "parallel.tp=2", "parallel.sp=true", "parallel.etp=1"),
    ),
    "moe.dispatcher_values": (TINY, MOE + ("parallel.moe_dispatcher=deepep",), MOE + ("parallel.moe_dispatcher=allgather",)),
    "moe.flex_needs_tp_ep": (MIX, ("parallel.moe_dispatcher=flex", "parallel.ep=1"), ("parallel.moe_dispatcher=flex",)),
    "moe.flex_needs_gpu": (TINY, MOE + ("parallel.moe_dispatcher=flex", "parallel.ep=2"), MOE + ("parallel.ep=2",)),
    "moe.allgather_vs_ep": (DSV3, ("parallel.moe_dispatcher=allgather",), ()),
    "ep.nvlink_domain": (DSV3, ("parallel.allow_inter_node_ep=false",), ()),
    "etp.nvlink_domain": (MIX, ("parallel.etp=16", "parallel.ep=1"), ("parallel.etp=2", "parallel.ep=4")),
    "ep_overlap.needs_ep": (TINY, OV[:2] + OV[3:], OV),
    "ep_overlap.dispatcher": (TINY, OV + ("parallel.moe_dispatcher=allgather",), OV + ("parallel.moe_dispatcher=alltoall",)),
    "ep_overlap.precision": (TINY, OV[:3] + OV[4:], OV),
    "ep_overlap.no_full_recompute": (TINY, OV + ("train.recompute=full",), OV + ("train.recompute=selective",)),
    "ep_overlap.pipeline_needs_vpp": (TINY, OV + OV_PP, OV + OV_VPP),
    "ep_overlap.mtp": (TINY, OV + ("model.mtp_num_layers=1",), OV + OV_VPP + ("model.mtp_num_layers=1",)),
    "ep_overlap.fsdp": (TINY, OV + ("parallel.fsdp=true",), OV),
    "ep_overlap.activation_offload": (TINY, OV + ("train.activation_offload_layers=1",), OV),
    "ep_overlap.delay_wgrad_needs_overlap": (TINY, OV[:4] + ("parallel.delay_wgrad_compute=true",), OV + ("parallel.delay_wgrad_compute=true",)),
    "ep_overlap.device_connections": (
        MIX, (DELAY[0], "+cluster.env.CUDA_DEVICE_MAX_CONNECTIONS='1'"), (DELAY[0], "+cluster.env.CUDA_DEVICE_MAX_CONNECTIONS='32'"),
    ),
    "cluster.gpu_arch": (TINY, ("cluster.gpu_arch=volta",), ()),
    "cluster.memory": (TINY, ("cluster.gpu_memory_gb=0",), ("cluster.gpu_memory_gb=4",)),
    "precision.values": (TINY, ("precision.params_dtype=fp64",), ("precision=bf16",)),
    "precision.fp8_needs_hopper": (TINY, ("precision=fp8_delayed",), ()),
    "precision.mxfp8_needs_blackwell": (L70, ("precision=mxfp8",), ("precision=mxfp8",) + GB200),
    "precision.nvfp4_needs_blackwell": (L70, ("precision=nvfp4",), ("precision=nvfp4",) + GB200),
    "precision.fp8_fp4_exclusive": (L70, ("precision=nvfp4", "precision.fp8=e4m3") + GB200, ("precision=fp8_blockwise",)),
    "precision.low_precision_needs_half_params": (L70, ("precision=fp8_delayed", "precision.params_dtype=fp32"), ("precision=fp8_delayed",)),
    "precision.fp8_param_gather": (L70, ("precision.fp8_param_gather=true",), ("precision=fp8_delayed", "precision.fp8_param_gather=true")),
    "precision.fp8_gemm_shapes": (L70, ("precision=fp8_delayed", "model.ffn_hidden_size=28680"), ("precision=fp8_tensorwise",)),
    "recompute.values": (TINY, ("train.recompute=partial",), ("train.recompute=selective",)),
    "recompute.num_layers": (TINY, ("train.recompute=full", "train.recompute_num_layers=5"), ("train.recompute=full", "train.recompute_num_layers=4")),
    "recompute.modules_values": (TINY, (SEL, "train.recompute_modules=[attention]"), (SEL, "train.recompute_modules=[core_attn,mlp]")),
    "recompute.modules_need_selective": (TINY, ("train.recompute_modules=[mlp]",), (SEL, "train.recompute_modules=[mlp]")),
    "recompute.modules_in_model": (TINY, (SEL, "train.recompute_modules=[mla_up_proj]"), (SEL, "train.recompute_modules=[layernorm]")),
    "recompute.fp8_delayed": (MIX, ("precision=fp8_delayed", SEL, "train.recompute_modules=[moe_act]"),
                              ("precision=fp8_tensorwise", SEL, "train.recompute_modules=[moe_act]")),
    "recompute.moe_with_ep_overlap": (TINY, OV + (SEL, "train.recompute_modules=[moe]"), OV + (SEL, "train.recompute_modules=[layernorm]")),
    "batch.positive": (TINY, ("train.train_iters=-1",), ("train.train_iters=0",)),
    "train.seed_run": (TINY, ("train.train_iters=0", "checkpoint.pretrained=base_ckpt"), ("train.train_iters=0",)),
    "batch.global_divisible": (TINY, ("train.global_batch_size=12",), ("train.global_batch_size=24",)),
    "optimizer.name": (TINY, ("optimizer.name=lion",), ("optimizer=sgd",)),
    "optimizer.distributed_needs_adam": (
        TINY, ("optimizer=sgd", "optimizer.use_distributed_optimizer=true"), ("optimizer=sgd",)
    ),
    "optimizer.learning_rate": (TINY, ("optimizer.min_lr=1.0",), ()),
    "optimizer.schedule": (TINY, ("optimizer.lr_warmup_iters=300",), ("optimizer.lr_warmup_iters=299",)),
    "optimizer.warmup_fraction": (TINY, ("optimizer.lr_warmup_fraction=1.0",), ("optimizer.lr_warmup_fraction=0.5", "train.train_iters=1")),
    "optimizer.hyperparameters": (TINY, ("optimizer.adam_beta2=1.0",), ("optimizer.adam_beta2=0.999",)),
    "optimizer.overlap_needs_distributed": (
        TINY,
        ("parallel.overlap_param_gather=true", "optimizer.use_distributed_optimizer=false"),
        ("parallel.overlap_param_gather=true",),
    ),
    "data.kind": (TINY, ("data.kind=parquet",), ("data=mock",)),
    "data.indexed_needs_blend": (TINY, ("data=indexed",), ("data=indexed", "data.blend=[corpus_text_document]")),
    "data.blend_format": (
        TINY,
        ("data=indexed", "data.blend=[0.5,a_text_document,b_text_document]"),
        ("data=indexed", "data.blend=[0.7,a_text_document,0.3,b_text_document]"),
    ),
    "data.split": (TINY, ("data.split='90,10'",), ("data.split='90,5,5'",)),
    "data.sft_needs_path": (TINY, ("data.kind=sft", PT), ("data.kind=sft", "data.sft_path=train.jsonl", PT)),
    "data.packing_micro_batch": (
        "llama3_8b_lora",
        ("data.sft_path=train.jsonl", PT, "train.micro_batch_size=2"),
        ("data.sft_path=train.jsonl", PT, "train.micro_batch_size=2", "data.packing=false"),
    ),
    "run.intervals": (TINY, ("logging.log_interval=0",), ()),
    "peft.method": (TINY, ("peft.method=adapter", PT), ("peft.method=lora", PT)),
    "peft.lora_values": (TINY, ("peft.method=lora", "peft.rank=0", PT), ("peft.method=lora", PT)),
    "peft.rank_fits": (TINY, ("peft.method=lora", "peft.rank=200", PT), ("peft.method=lora", "peft.rank=64", PT)),
    "peft.nf4_blocks": (TINY, ("peft.method=qlora", "peft.nf4_block_size=48", PT), ("peft.method=qlora", PT)),
    "peft.prefix_room": (TINY, ("peft.method=ptuning", "peft.prefix_length=400", PT), ("peft.method=ptuning", PT)),
    "peft.prefix_layout": (
        L70,
        ("peft.method=ptuning", "train.seq_length=4096", PT),
        ("peft.method=ptuning", "train.seq_length=4096", "parallel.cp=1", PT),
    ),
    "peft.needs_pretrained": (TINY, ("peft.method=lora",), ("peft.method=lora", PT)),
    "peft.modules_to_save": (
        TINY,
        ("peft.method=lora", "peft.modules_to_save=[output_layer]", "model.tie_embeddings=true", PT),
        ("peft.method=lora", "peft.modules_to_save=[output_layer]", PT),
    ),
    "sharding.values": (TINY, ("parallel.sharding=zero4",), ("parallel.sharding=zero1",)),
    "sharding.needs_distributed_optimizer": (
        TINY,
        ("parallel=none", "parallel.dist_optimizer_instances=2", "optimizer.use_distributed_optimizer=false"),
        ("parallel=none", "parallel.dist_optimizer_instances=2"),
    ),
    "sharding.zero23_need_fsdp": (TINY, ("parallel=none", "parallel.sharding=zero3"), FS + ("parallel.sharding=zero3",)),
    "sharding.instances_divide_dp": (
        TINY, ("parallel=none", "parallel.dist_optimizer_instances=4"), ("parallel=none", "parallel.dist_optimizer_instances=2")
    ),
    "fsdp.no_hybrid_instances": (
        TINY, FS + ("parallel.dist_optimizer_instances=2",), ("parallel=none", "parallel.dist_optimizer_instances=2")
    ),
    "fsdp.not_with_peft": (TINY, FS + ("peft.method=lora", PT), ("parallel=none", "peft.method=lora", PT)),
    "fsdp.fp8_params_from_checkpoint": (L8, FP8_FSDP + (PT,), FP8_FSDP),
    "fsdp.no_pipeline": (TINY, FS + ("parallel.pp=2",), FS),
    "fsdp.checkpoint_format": (TINY, ("parallel.fsdp=true",), ("parallel=none", "parallel.fsdp=true")),  # TP2 / TP1
    "offload.needs_gpu": (TINY, ("optimizer.cpu_offload=true", "precision=bf16", "cluster.host_memory_gb=16"), ()),
    "offload.optimizer_precision": (F70, SFT + ("precision.params_dtype=fp16", "optimizer=sgd"), SFT + ("precision.params_dtype=fp16",)),
    "offload.host_memory_known": (F70, SFT + ("cluster.host_memory_gb=0",), SFT),
    "offload.activation_layers": (L8, ("train.activation_offload_layers=32",), ("train.activation_offload_layers=8",)),
    "memory.host_fits": (F70, SFT + ("cluster.host_memory_gb=256",), SFT),
    "slurm.account": (TINY, ("cluster.require_account=true",), ("cluster.require_account=true", "cluster.account=a", "cluster.partition=p")),
    "slurm.time_limit": (TINY, ("cluster.time_limit=soon",), ("cluster.time_limit=04:00:00",)),
    "slurm.preempt_signal": (TINY, ("cluster.preempt_signal=KILL",), ("cluster.preempt_signal=USR2",)),
    "slurm.preempt_lead": (
        TINY, ("cluster.time_limit=00:05:00", "cluster.preempt_signal_lead_s=300"),
        ("cluster.time_limit=00:10:00", "cluster.preempt_signal_lead_s=300"),
    ),
    "slurm.max_restarts": (TINY, ("cluster.max_restarts=-1",), ("cluster.max_restarts=0",)),
    "slurm.launcher": (TINY, ("cluster.launcher=mpirun",), ("cluster.launcher=pmix",)),
    "slurm.gpu_request": (TINY, ("cluster.gpu_request=gpus",), ("cluster.gpu_request=gres",)),
    "slurm.cpus": (TINY, ("cluster.cpus_per_task=1",), ("cluster.cpus_per_task=2",)),
    "slurm.mem": (TINY, ("cluster.sbatch_extra=['--mem-per-gpu=200G']",),
                  ("cluster.mem=null", "cluster.sbatch_extra=['--mem-per-gpu=200G']")),
    "slurm.extra_format": (TINY, ("cluster.sbatch_extra=['qos=high']",), ("cluster.sbatch_extra=['--qos=high']",)),
    "slurm.extra_owned": (TINY, ("cluster.srun_extra=['--nodes=4']",), ("cluster.srun_extra=['--exclusive']",)),
    "slurm.env_name": (TINY, ("+cluster.env.MY-VAR=a",), ("+cluster.env.MY_VAR=a",)),
    # a GPU cluster without an image would run this machine's Python on the nodes (issue 29)
    "slurm.container_chosen": (TINY, ("cluster.gpu_arch=hopper",), ("cluster.gpu_arch=hopper", "cluster.container_image=none")),
    "slurm.container_image": (TINY, ("cluster.container_workdir=/w",), MOUNTED + ("cluster.container_workdir=/w",)),
    "slurm.mount_syntax": (TINY, IMAGE + ("cluster.container_mounts=['/runs,/data']",), MOUNTED),
    "slurm.mount_source": (
        TINY, IMAGE + (f"cluster.container_mounts=['/runs','{HERE / 'no-such-folder'}:/data']",),
        IMAGE + (f"cluster.container_mounts=['/runs','{HERE}:/data']",),
    ),
    "slurm.workdir": (TINY, MOUNTED + ("cluster.container_workdir=w",), MOUNTED + ("cluster.container_workdir=/runs",)),
    "slurm.run_dir_mounted": (TINY, IMAGE + ("cluster.container_mounts=['/data']",), MOUNTED),
    "slurm.run_dir": (TINY, ("run.dir=runs/100%",), ("run.dir=runs/100",)),
    "machine.fp8_needs_te": (L70, ("precision=fp8_delayed",), ("precision=fp8_delayed",), (H100_NO_TE, H100)),
    "machine.fp4_needs_te": (L70, ("precision=nvfp4",) + GB200, ("precision=nvfp4",) + GB200, (CPU, B200)),
    "machine.cp_attention": (L70, (), ("parallel.cp_comm_type=all_gather",), (CPU, CPU)),
    "machine.packed_thd": (TINY, PACKED + ("train.micro_batch_size=2",), PACKED + ("train.micro_batch_size=1",), (H100, H100)),
    "machine.flex_needs_deep_ep": (MIX, ("parallel.moe_dispatcher=flex",), ("parallel.moe_dispatcher=flex",), (H100, H100_DEEP_EP)),
    "machine.optimizer_offload": (F70, SFT, SFT, (H100_NO_TE, H100)),
    "machine.activation_offload": (L8, ("train.activation_offload_layers=8",), ("train.activation_offload_layers=8",), (CPU, H100)),
    "machine.fp16_needs_gpu": (TINY, ("precision.params_dtype=fp16",), ("precision.params_dtype=fp16",), (CPU, H100)),
    "machine.fp8_compute_capability": (L70, ("precision=fp8_delayed",), ("precision=fp8_delayed",), (A100, H100)),
    "machine.blackwell": (L70, ("precision=nvfp4",) + GB200, ("precision=nvfp4",) + GB200, (H100, B200)),
    # MIX overlaps gradient reduction: deferred weight gradients need TE 2.8 there (2.7 reduces too early)
    "machine.delay_wgrad_needs_te": (MIX, DELAY, DELAY, (H100_TE27, H100_TE29)),
    "machine.recompute_modules_need_te": (MIX, (SEL, "train.recompute_modules=[moe_act]"), (SEL, "train.recompute_modules=[moe_act]"),
                                          (H100_NO_TE, H100)),
    "memory.fits": (L70, ("parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.cp=1", "parallel.sp=false"), ()),
}


@lru_cache(maxsize=None)
def _violations(recipe: str, overrides: Tuple[str, ...], scope: str = "recipe", machine: Machine = CPU) -> List[str]:
    """Rule ids violated, judged by the recipe and input rules plus those of ``scope`` (on ``machine``)."""
    rules = select(("recipe", "input", scope))
    return [v.rule_id for v in validate(compose_recipe(recipe, list(overrides)), rules=rules, host=Host(machine=machine))]


def _judged(rule_id: str, side: int) -> List[str]:
    """The violations of a case's failing (side 0) or passing (side 1) recipe."""
    recipe, bad, good, *machines = CASES[rule_id]
    machine = machines[0][side] if machines else CPU
    return _violations(recipe, (bad, good)[side], rules_by_id()[rule_id].scope, machine)


def test_every_rule_has_a_case():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)), "duplicate rule ids"
    missing = sorted(set(ids) - set(CASES))
    stale = sorted(set(CASES) - set(ids))
    assert not missing, f"rules without a failing/passing case in tests/test_rules.py: {missing}"
    assert not stale, f"cases for rules that no longer exist: {stale}"
    assert len(RULES) >= 40


def test_rule_entries_are_complete():
    tiny = compose_recipe(TINY)
    for r in RULES:
        assert r.id and r.fields and r.message and callable(r.check), r.id
        assert r.fix_text(tiny), r.id


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fails_on_its_bad_recipe(rule_id):
    recipe, bad, *_ = CASES[rule_id]
    found = _judged(rule_id, 0)
    assert rule_id in found, f"{recipe} {' '.join(bad)} should violate {rule_id}; got {found}"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_passes_on_its_good_recipe(rule_id):
    recipe, _, good, *_ = CASES[rule_id]
    found = _judged(rule_id, 1)
    assert found == [], f"{recipe} {' '.join(good)} should pass every rule; got {found}"


def test_messages_name_values_and_valid_choices():
    cfg = compose_recipe(L70, ["parallel.tp=16"])
    by_id = {v.rule_id: v for v in validate(cfg)}
    assert by_id["tp.query_groups"].message == "num_query_groups=8 is not divisible by parallel.tp=16; use parallel.tp in {1, 2, 4, 8}"
    nvlink = by_id["tp.nvlink_domain"].message
    assert "parallel.tp=16" in nvlink and "NVLink domain" in nvlink and "{1, 2, 4, 8}" in nvlink
    assert by_id["tp.nvlink_domain"].fix and "allow_inter_node_tp" in by_id["tp.nvlink_domain"].fix


def test_inter_node_tp_is_allowed_only_explicitly():
    assert "tp.nvlink_domain" not in _violations(L70, ("parallel.tp=16", "parallel.allow_inter_node_tp=true"))
    assert "tp.nvlink_domain" in _violations(L70, ("parallel.tp=16",))


def test_gb200_nvlink_domain_spans_nodes():
    """On NVL72 a TP group may leave its 4-GPU node as long as it stays in the 72-GPU domain."""
    base = ("cluster=gb200_nvl72", "cluster.nodes=18", "parallel.tp=8", "parallel.pp=9", "parallel.vpp=null",
            "parallel.cp=1", "train.global_batch_size=144", "model.num_layers=81")
    found = _violations(L70, base)
    assert "tp.nvlink_domain" not in found and "tp.nvlink_domain" in _violations(L70, base[:-1] + ("parallel.tp=16",) + base[-1:])


def test_validate_or_raise_lists_every_violated_rule():
    cfg = compose_recipe(TINY, ["cluster.gpus_per_node=3", "optimizer.min_lr=1.0", "data.kind=parquet"])
    with pytest.raises(ValidationError) as info:
        validate_or_raise(cfg, "tiny_llama_cpu")
    ids = {v.rule_id for v in info.value.violations}
    assert {"layout.world_factorisation", "optimizer.learning_rate", "data.kind"} <= ids
    text = str(info.value)
    assert text.startswith("tiny_llama_cpu: ") and all(f"[{i}]" in text for i in ids) and "fix:" in text


def test_rules_by_id_covers_table():
    assert set(rules_by_id()) == {r.id for r in RULES}


def test_pp_layer_split_with_embedding_and_loss_counted():
    """pp.layer_split's third way: the embedding/loss each take a layer's slot (megatron-core's
    account_for_*_in_pipeline_split), and it cannot be combined with first/last-stage sizes."""
    counted = ("model.num_layers=6", "parallel.account_for_embedding_in_pipeline_split=true",
               "parallel.account_for_loss_in_pipeline_split=true")
    ok = compose_recipe(TINY, list(PP2 + counted + ("parallel.vpp=2",)))
    assert "pp.layer_split" not in {v.rule_id for v in validate(ok)}  # 6 + 2 = 2 x 2 x 2
    bad = compose_recipe(TINY, list(PP2 + counted[:2] + ("parallel.vpp=2",)))  # 6 + 1 over 4 chunks
    assert "pp.layer_split" in {v.rule_id for v in validate(bad)}
    both = compose_recipe(TINY, list(PP2 + counted + ("parallel.num_layers_in_first_pipeline_stage=3",)))
    msg = next(v.message for v in validate(both) if v.rule_id == "pp.layer_split")
    assert "cannot be combined" in msg


def test_a_pipeline_layout_does_not_switch_off_the_rules_that_need_the_layer_split():
    """Rules that need a valid layer split (memory.fits among them) judge a recipe with parallel.pipeline_layout
    by its layout; they were skipped silently, so a layout that did not fit passed."""
    assert "memory.fits" in _violations("deepseek_v3_pretrain", ("train.recompute=none",))
    assert "memory.fits" not in _violations("deepseek_v3_pretrain", ())
