"""A recipe made small enough for CPU ranks, keeping what its parallel layout depends on.

What is kept: the parallel degrees (TP, PP, VPP, CP, EP, ETP, SP; DP and, where the world still exceeds the
rank budget, the largest other degrees are scaled down and each change is reported), the layers of every
pipeline stage and virtual chunk (uneven first/last stages included), heads and query groups divisible as
TP needs (GQA stays GQA), the number of experts, router top-k and grouping, MLA/MoE/shared-expert/MTP
structure, a sequence length divisible by 2*CP (and by TP under SP), and whether the vocabulary is padded (the remainder
modulo make_vocab_size_divisible_by x TP is kept). What shrinks: widths, vocabulary, sequence, batch.

Everything is expressed as Hydra overrides on the user's own recipe, so the check trains the recipe
through the same composition, rule table and trainer as ``megatron-recipes train``.

CP>1 runs with ``cp_comm_type=all_gather``: the only CP attention without Transformer Engine (the local
spec's, models/context_parallel.py). The recipe's own exchange (p2p, a2a, a2a+p2p) is TE's and is only
validated by the rule table; the shrunk layout says so in its notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig

HIDDEN, HEAD_DIM, FFN, MOE_FFN, SEQ = 64, 16, 128, 32, 32
TINY_HIDDEN = 256
LAYERS_PER_CHUNK = 2  # default depth cap of an evenly split chunk (a 128-expert layer costs seconds on CPU)  # a model this narrow (the tiny_* recipes) keeps its architecture untouched


@dataclass
class Degrees:
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def min_dp(self) -> int:
        """Smallest DP whose world holds whole expert groups: ep*etp divides tp*cp*dp (megatron-core)."""
        need = self.ep * self.etp
        return need // math.gcd(need, self.tp * self.cp)

    def text(self, vpp: Optional[int]) -> str:
        v = f" VPP{vpp}" if vpp else ""
        e = f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp != self.tp else "") if self.ep > 1 else ""
        return f"TP{self.tp} PP{self.pp}{v} CP{self.cp}{e} DP{self.dp} ({self.world} ranks)"


@dataclass
class Shrunk:
    """The check's recipe: overrides for the layout run, the one-rank reference, and what was changed."""

    layout: List[str]
    reference: List[str]
    degrees: Degrees
    original: Degrees
    notes: List[str] = field(default_factory=list)  # every change a user should know about
    reduced: List[str] = field(default_factory=list)  # model-parallel degrees that were reduced (not DP)


def recipe_degrees(cfg: RunConfig) -> Degrees:
    p = cfg.parallel
    return Degrees(p.tp, p.pp, p.cp, p.ep, derived.expert_tensor_parallel_size(cfg), derived.data_parallel_size(cfg))


def fit_degrees(d: Degrees, max_ranks: int, moe: bool = True) -> tuple:
    """Scale DP down first, then halve the largest model-parallel degree until the world fits; (degrees, notes)."""
    notes: List[str] = []
    if d.world <= max_ranks:
        return d, notes
    fitted = replace(d)
    fitted.dp = fitted.min_dp()  # DP first: down to the fewest replicas that hold whole expert groups
    halved: List[str] = []
    while fitted.world > max_ranks:
        # then the largest model-parallel degree halves (ties: EP, PP, ETP, TP, CP); none goes below 1
        order = [("ep", fitted.ep), ("pp", fitted.pp), ("etp", fitted.etp if moe else 1), ("tp", fitted.tp), ("cp", fitted.cp)]
        name, value = max(order, key=lambda kv: kv[1])
        if value <= 1:
            break
        setattr(fitted, name, value // 2)
        if name == "tp" and fitted.etp > fitted.tp and (d.etp == d.tp or not moe):
            fitted.etp = fitted.tp  # ETP follows TP when the recipe leaves it unset
        fitted.dp = fitted.min_dp()
        halved.append(
            f"{name.upper()} {value} -> {value // 2}: with DP at its minimum the world still exceeded --max-ranks "
            f"{max_ranks}; this check does NOT prove {name.upper()}={value} itself"
        )
    step = fitted.min_dp()  # as many DP replicas as still fit (DP>1 keeps gradient reduction in the proof)
    fitted.dp = max(k for k in range(step, max(d.dp, step) + 1, step) if k == step or k * fitted.world // fitted.dp <= max_ranks)
    notes.append(
        f"DP {d.dp} -> {fitted.dp}: the recipe's {d.world} ranks exceed --max-ranks {max_ranks}; DP replicas run "
        "the same code on other data, so fewer of them prove the same layout"
    )
    return fitted, notes + halved


def lane_merges_mtp(cfg: RunConfig, pp: int) -> bool:
    """An MTP stage of its own under interleaving hangs the CPU lane: megatron-core's shape exchange before each
    pipeline transfer (``mtp_standalone``) deadlocked at PP=4 x VPP=2 over gloo (found by ``check
    deepseek_v3_pretrain``; PP=3 x VPP=2 and no interleaving ran). The check then proves the layout with the
    MTP layer on the loss's stage, and says so."""
    from megatron_recipes.config import pipeline_layout

    p = cfg.parallel
    if not p.pipeline_layout or not p.vpp or pp < 2:
        return False
    return pipeline_layout.standalone_mtp(pipeline_layout.shrink(p.pipeline_layout, p.pp, pp, None), pp)


def _layers(cfg: RunConfig, pp: int, max_per_chunk: Optional[int]) -> Dict[str, object]:
    """Layer count for ``pp`` stages with the recipe's layers per stage/chunk (uneven first/last stages
    kept as they are); ``max_per_chunk`` caps the even part, so a 24-layer stage runs as 2 on CPU."""
    p, m = cfg.parallel, cfg.model
    vpp = p.vpp or 1
    if p.pipeline_layout and pp > 1:  # the same kinds of stages (embedding, MTP, loss placed as the layout does)
        from megatron_recipes.config import pipeline_layout

        shrunk = pipeline_layout.shrink(p.pipeline_layout, p.pp, pp, max_per_chunk, merge_closing=lane_merges_mtp(cfg, pp))
        return {"model.num_layers": "".join(pipeline_layout.stages(shrunk)).count("t"), "parallel.pipeline_layout": shrunk}
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    cap = (lambda n: min(n, max_per_chunk)) if max_per_chunk else (lambda n: n)  # noqa: E731
    if first is None and last is None:
        # the embedding and the loss may each take a layer's slot (account_for_*_in_pipeline_split)
        counted = int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)
        per_chunk = cap((m.num_layers + (counted if p.pp > 1 else 0)) // (p.pp * vpp))
        return {"model.num_layers": per_chunk * pp * vpp - (counted if pp > 1 else 0)}
    middle_stages = p.pp - (first is not None) - (last is not None)
    per_middle = cap((m.num_layers - (first or 0) - (last or 0)) // max(1, middle_stages))
    new_middle = max(0, pp - (first is not None) - (last is not None))
    return {"model.num_layers": (first or 0) + (last or 0) + per_middle * new_middle}


def _model(cfg: RunConfig, d: Degrees, max_per_chunk: Optional[int]) -> Dict[str, object]:
    """Narrow widths; counts the layout divides (heads, groups, experts, layers) kept divisible."""
    m = cfg.model
    out: Dict[str, object] = dict(_layers(cfg, d.pp, max_per_chunk))
    if m.hidden_size <= TINY_HIDDEN:
        return out
    gqa = m.num_query_groups < m.num_attention_heads
    groups = d.tp * (2 if d.cp > 1 else 1)  # a2a CP splits heads over CP as well
    heads = groups * (2 if gqa else 1)
    multiple = max(1, m.make_vocab_size_divisible_by) * d.tp
    out.update(
        {
            "model.hidden_size": HIDDEN,
            "model.num_attention_heads": heads,
            "model.num_query_groups": heads if m.multi_latent_attention else groups,
            "model.kv_channels": HEAD_DIM,
            "model.ffn_hidden_size": FFN,
            # at least 1024 rows (the check's built-in tokenizer has 600 tokens), same remainder as the recipe's
            "model.vocab_size": multiple * max(2, -(-1024 // multiple)) + m.vocab_size % multiple,
        }
    )
    if cfg.peft.method == "qlora":
        # every quantised linear's input features per rank must hold whole NF4 blocks (rule peft.nf4_blocks)
        block, kv, ffn, hidden = cfg.peft.nf4_block_size, HEAD_DIM, FFN, HIDDEN
        while (heads * kv // d.tp) % block:
            kv *= 2
        while (ffn // d.tp) % block:
            ffn *= 2
        while hidden % block:
            hidden *= 2
        out.update({"model.kv_channels": kv, "model.ffn_hidden_size": ffn, "model.hidden_size": hidden})
    if m.sliding_window:
        out["model.sliding_window"] = SEQ // 2
    if m.num_moe_experts:
        out["model.moe_ffn_hidden_size"] = MOE_FFN
        if m.moe_shared_expert_intermediate_size:
            out["model.moe_shared_expert_intermediate_size"] = 2 * MOE_FFN
        layers = int(out["model.num_layers"])
        if m.moe_first_dense_layers >= layers:
            out["model.moe_first_dense_layers"] = layers - 1
    if m.multi_latent_attention:
        out.update({"model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_head_dim": HEAD_DIM,
                    "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": HEAD_DIM})
    return out


def _batch(cfg: RunConfig, d: Degrees, own_data: bool) -> Dict[str, object]:
    """Micro-batches of one sequence; PP of them per DP rank (the pipeline fills, interleaving takes whole
    rounds), at least 2 (gradient accumulation is part of the proof)."""
    micro = max(d.pp, 2)
    # Chat samples must fit whole (SFT drops or refuses longer ones), so SFT on its own data keeps the
    # recipe's length; on mock tokens any length is a sample.
    base = cfg.train.seq_length if cfg.data.kind == "sft" and own_data else SEQ
    return {"train.seq_length": seq_length(d, cfg.parallel.sp, base), "train.micro_batch_size": 1,
            "train.global_batch_size": micro * d.dp}


def seq_length(d: Degrees, sp: bool, base: int = SEQ) -> int:
    """The smallest multiple of 2*CP (load-balanced causal chunks) and of TP under SP that is >= ``base``."""
    step = math.lcm(2 * d.cp if d.cp > 1 else 1, d.tp if sp else 1)
    return step * -(-base // step)


def _fmt(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and any(c in value for c in "|*(),[]{}= "):  # a pipeline layout: one quoted value
        return "'" + value + "'"
    return str(value)


def shrink(cfg: RunConfig, max_ranks: int = 8, max_layers_per_chunk: Optional[int] = LAYERS_PER_CHUNK,
           own_data: bool = True) -> Shrunk:
    """The check's overrides; ``max_layers_per_chunk=None`` keeps every stage's full depth; ``own_data``:
    the runs read the recipe's own data (else mock tokens)."""
    original = recipe_degrees(cfg)
    d, notes = fit_degrees(original, max_ranks, moe=bool(cfg.model.num_moe_experts))
    p = cfg.parallel
    common: Dict[str, object] = {**_model(cfg, d, max_layers_per_chunk), **_batch(cfg, d, own_data)}
    if lane_merges_mtp(cfg, d.pp):
        notes.append(f"pipeline layout -> {common['parallel.pipeline_layout']}: the MTP layer shares the loss's stage; "
                     "an MTP stage of its own under interleaving deadlocks the CPU lane's gloo pipeline exchange "
                     "(megatron-core's shape exchange, mtp_standalone): that placement is validated, not proven")
    if max_layers_per_chunk and cfg.model.hidden_size > TINY_HIDDEN:
        full = _layers(cfg, d.pp, None)["model.num_layers"]
        if full != common["model.num_layers"]:
            notes.append(
                f"layers {full} -> {common['model.num_layers']}: at most {max_layers_per_chunk} per pipeline chunk "
                "(uneven first/last stages kept as written); --full-depth keeps every stage's layer count"
            )
    if cfg.peft.dropout > 0:
        # Each layout draws its own masks (a TP rank draws its shard's from megatron-core's per-rank
        # stream), so with dropout on no layout can match one rank step by step; the masks' agreement
        # across TP replicas is proven by tests/test_peft_parallel.py instead.
        common["peft.dropout"] = 0.0
        notes.append(f"adapter dropout {cfg.peft.dropout:g} -> 0: dropout masks are drawn per layout, so they "
                     "cannot match one rank's; the layout is proven without them")
    if cfg.peft.method == "qlora" and cfg.peft.double_quant:
        # Double quantisation compresses each rank's own block scales (their mean and second-level blocks),
        # so every TP layout holds a slightly different NF4 base (2.7e-5 relative in the step-1 loss of
        # tiny_llama_qlora at TP=2); the first-level NF4 blocks tile each rank's rows and stay identical.
        common["peft.double_quant"] = False
        notes.append("QLoRA double quantisation -> off: each rank compresses its own shard's block scales, so "
                     "layouts hold slightly different NF4 bases; the layout is proven on the first-level NF4 blocks")
    if cfg.model.hidden_size > TINY_HIDDEN:
        m = cfg.model
        moe = f", expert FFN {MOE_FFN}; {m.num_moe_experts} experts, top-{m.moe_router_topk} kept" if m.num_moe_experts else ""
        notes.append(f"model narrowed to hidden {common['model.hidden_size']}, head dim {common['model.kv_channels']}, "
                     f"FFN {common['model.ffn_hidden_size']}{moe}; {common['model.num_layers']} layers")
    offload: Dict[str, object] = {}
    if cfg.optimizer.cpu_offload:
        offload["optimizer.cpu_offload"] = False
    if cfg.train.activation_offload_layers:
        offload["train.activation_offload_layers"] = 0
    if offload:
        # host-memory placement of optimizer state / activations: where numbers live, not what they are
        common.update(offload)
        notes.append(f"{', '.join(f'{k} -> {_fmt(v)}' for k, v in offload.items())}: offloading to host memory "
                     "moves where tensors live, not the training math; the CPU lane has no device memory to offload from")
    t = cfg.train
    if t.recompute == "selective" and "moe_act" in t.recompute_modules:
        # megatron-core recomputes the expert activation only in grouped experts (TE's here); recompute changes what
        # a layer keeps for backward, not what it computes (the lane's modules: tests/test_recompute.py)
        kept = [name for name in t.recompute_modules if name != "moe_act"]
        common.update({"train.recompute": "selective" if kept else "none", "train.recompute_modules": kept or ["core_attn"]})
        notes.append("moe_act recompute -> off: it runs in Transformer Engine's grouped experts only; recomputing "
                     "changes which activations are kept, not the numbers")
    layout = dict(common)
    layout.update({"parallel.tp": d.tp, "parallel.pp": d.pp, "parallel.cp": d.cp, "parallel.ep": d.ep,
                   "parallel.etp": d.etp if p.etp is not None else None,
                   "cluster.gpus_per_node": d.world, "cluster.nvlink_domain": d.world})
    if d.cp > 1 and p.cp_comm_type != "all_gather":
        layout.update({"parallel.cp_comm_type": "all_gather", "parallel.cp_hierarchical_sizes": None})
        notes.append(
            f"CP={d.cp} runs with cp_comm_type=all_gather, the only CP attention on the CPU lane; the recipe's "
            f"{p.cp_comm_type} exchange needs Transformer Engine and is validated only, not proven"
        )
    if d.pp == 1:
        layout.update({"parallel.vpp": None, "parallel.pipeline_layout": None,
                       "parallel.num_layers_in_first_pipeline_stage": None,
                       "parallel.num_layers_in_last_pipeline_stage": None,
                       "parallel.account_for_embedding_in_pipeline_split": False,
                       "parallel.account_for_loss_in_pipeline_split": False})
    names = ("tp", "pp", "cp", "ep", "etp") if cfg.model.num_moe_experts else ("tp", "pp", "cp")
    reduced = [n for n in names if getattr(d, n) != getattr(original, n)]
    # The reference: one rank, the same model; its vocabulary padded to the layout's row count.
    multiple = max(1, cfg.model.make_vocab_size_divisible_by) * d.tp
    reference = dict(common)
    reference.update({"parallel.tp": 1, "parallel.pp": 1, "parallel.vpp": None, "parallel.pipeline_layout": None,
                      "parallel.cp": 1, "parallel.ep": 1,
                      "parallel.etp": None, "parallel.sp": False,
                      "parallel.num_layers_in_first_pipeline_stage": None,
                      "parallel.num_layers_in_last_pipeline_stage": None,
                      "parallel.account_for_embedding_in_pipeline_split": False,
                      "parallel.account_for_loss_in_pipeline_split": False,
                      "model.make_vocab_size_divisible_by": multiple,
                      "cluster.gpus_per_node": 1, "cluster.nvlink_domain": 1})
    if p.fsdp:
        # The plain one-rank path (megatron-core DDP, distributed optimizer): an independent reference for a
        # Megatron-FSDP layout, which shards nothing over one rank anyway.
        reference.update({"parallel.fsdp": False, "parallel.sharding": "zero1"})
        notes.append(f"the one-rank reference runs without Megatron-FSDP (parallel.fsdp=false, sharding zero1): "
                     f"the layout's {p.sharding} sharding is compared with megatron-core's plain data-parallel path")
    to_list = lambda kv: [f"{k}={_fmt(v)}" for k, v in kv.items()]  # noqa: E731
    return Shrunk(to_list(layout), to_list(reference), d, original, notes, reduced)
