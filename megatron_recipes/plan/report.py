"""Terminal rendering of a plan and of search results (rich tables)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from rich.console import Console
from rich.table import Table

from megatron_recipes.estimate.memory import GB
from megatron_recipes.plan.search import SearchResult

GROUP_ORDER = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "etp", "edp")


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]NO[/red]"


def _fmt_params(n: float) -> str:
    from megatron_recipes.progress import count

    return count(n)


def _ranks(groups: List[List[int]], limit: int = 3) -> str:
    def one(g: List[int]) -> str:
        if len(g) > 8:
            return "[" + ", ".join(map(str, g[:4])) + ", ..., " + str(g[-1]) + "]"
        return "[" + ", ".join(map(str, g)) + "]"

    text = " ".join(one(g) for g in groups[:limit])
    return text + (" ..." if len(groups) > limit else "")


def render_plan(plan: Dict[str, Any], console: Console, all_groups: bool = False) -> None:
    from megatron_recipes.progress import parameters

    lay, mdl, cl = plan["layout"], plan["model"], plan["cluster"]
    console.print(
        f"[bold]{plan['recipe']}[/bold]: model {mdl['name']}, {parameters(mdl['params'], _fmt_params(mdl['active_params']) + ' active')}, "
        f"on {cl['name']} "
        f"({lay['nodes']} nodes x {lay['gpus_per_node']} GPUs = world {lay['world_size']}, "
        f"{cl['gpu_arch']}, {cl['gpu_memory_gb']:g} GB, NVLink domain {cl['nvlink_domain']})"
    )
    t = Table(title="layout", show_header=True)
    moe = plan["model"]["active_params"] != plan["model"]["params"]
    cols = ["tp", "pp", "vpp", "cp", "dp", "sp"] + (["ep", "etp", "expert_dp"] if moe else [])
    cols += ["micro_batch_size", "global_batch_size", "num_microbatches", "seq_length", "recompute"]
    names = {"expert_dp": "expert dp", "micro_batch_size": "mbs", "global_batch_size": "gbs",
             "num_microbatches": "microbatches", "seq_length": "seq"}
    for col in cols:
        t.add_column(names.get(col, col), justify="right")
    t.add_row(*(str(lay[c] if lay[c] is not None else "-") for c in cols))
    console.print(t)
    if lay.get("recompute_modules"):
        console.print("selective recompute of: " + ", ".join(lay["recompute_modules"]))
    stages = lay["layers_per_stage"]
    console.print("layers per pipeline stage (per virtual chunk): " + " | ".join("+".join(map(str, s)) for s in stages[:16])
                  + (" | ..." if len(stages) > 16 else ""))
    _render_groups(plan, console, all_groups)
    _render_memory(plan["memory"], console)
    _render_checkpoint(plan["checkpoint"], console)
    _render_time(plan["step_time"], console)


def _render_groups(plan: Dict[str, Any], console: Console, all_groups: bool) -> None:
    g = Table(title=f"parallel groups (megatron-core order {plan['order']})")
    for col, just in (("kind", "left"), ("size", "right"), ("groups", "right"), ("intra-node", "center"),
                      ("intra-NVLink", "center"), ("max nodes", "right"), ("ranks", "left")):
        g.add_column(col, justify=just)
    for name in GROUP_ORDER:
        if name not in plan["groups"]:
            continue
        k = plan["groups"][name]
        if k["size"] == 1 and name not in ("tp", "dp", "pp"):
            continue  # a degree of 1 has nothing to show
        if name == "dp_cp" and plan["layout"]["cp"] == 1:
            continue  # the same groups as dp
        limit = len(k["groups"]) if all_groups else 3
        g.add_row(name, str(k["size"]), str(k["count"]), _mark(k["intra_node"]), _mark(k["intra_nvlink_domain"]),
                  str(k["max_nodes_spanned"]), _ranks(k["groups"], limit))
    console.print(g)
    ranks = plan["ranks"]
    kinds = [k for k in GROUP_ORDER if k in plan["groups"] and plan["groups"][k]["size"] > 1
             and not (k == "dp_cp" and plan["layout"]["cp"] == 1)]
    if not all_groups and len(ranks) < plan["layout"]["world_size"]:
        console.print(f"rank -> index in each group: first {len(ranks)} of {plan['layout']['world_size']} ranks (--all-groups for all)")
    r = Table(title="rank -> group index")
    for col in ["rank", "node"] + kinds:
        r.add_column(col, justify="right")
    for row in ranks:
        r.add_row(*(str(row[c]) for c in ["rank", "node"] + kinds))
    console.print(r)


def _render_memory(mem: Dict[str, Any], console: Console) -> None:
    t = Table(title="memory per GPU (GB)")
    for col in ("stage", "params", "weights", "grads", "optimizer", "act/mb", "in flight", "activations", "recompute", "overhead", "total"):
        t.add_column(col, justify="right")
    stages = mem["stages"]
    shown = stages if len(stages) <= 6 else stages[:3] + [s for s in stages[3:-2] if s["pp_rank"] == mem["worst_stage"]] + stages[-2:]
    for s in shown:
        t.add_row(str(s["pp_rank"]), _fmt_params(s["params"]), f"{s['weights_gb']:.2f}", f"{s['grads_gb']:.2f}",
                  f"{s['optimizer_gb']:.2f}", f"{s['activations_per_microbatch_gb']:.2f}", f"{s['microbatches_in_flight']:g}",
                  f"{s['activations_gb']:.2f}", f"{s['recompute_transient_gb']:.2f}", f"{s['overhead_gb']:.2f}", f"{s['total_gb']:.2f}")
    console.print(t)
    console.print("exact: params (megatron-core's shapes), weights/grads/optimizer bytes per parameter; estimated: "
                  "activations (Transformer Engine kernels on GPUs: not measured here), overhead (CUDA context, "
                  "NCCL, workspaces and allocator fragmentation: assumed, estimate/memory.py)")
    console.print(f"pipeline bubble: {mem['bubble_fraction'] * 100:.1f}% of the step")
    sh = mem["sharding"]
    console.print(f"sharding: {sh['stage']}{' (Megatron-FSDP)' if sh['fsdp'] else ''} over {sh['dense_shard_ranks']} ranks "
                  f"(experts {sh['expert_shard_ranks']}), {sh['instances']} instance(s); optimizer offload "
                  f"{sh['optimizer_offload_fraction'] * 100:.0f}%")
    if mem["host_offload_per_node_gb"] > 0:
        cap = f"{mem['host_capacity_gb']:.0f} GB" if mem["host_capacity_gb"] > 0 else "unknown RAM"
        console.print(f"host memory per node: {mem['host_offload_per_node_gb']:.0f} GB offloaded optimizer state of {cap} "
                      f"({_mark(mem['host_fits'])})")
    verdict = "[bold green]FITS[/bold green]" if mem["fits"] else "[bold red]DOES NOT FIT[/bold red]"
    word = "margin" if mem["fits"] else "short by"
    console.print(f"verdict: {verdict}: the fullest GPU (stage {mem['worst_stage']}) needs {mem['worst_total_gb']:.1f} of "
                  f"{mem['capacity_gb']:.1f} GB, {word} {abs(mem['margin_gb']):.1f} GB")


def _render_checkpoint(ck: Dict[str, Any], console: Console) -> None:
    console.print(f"checkpoint optimizer format: {ck['optimizer_format']} ({ck['why']})")
    if ck["gather_large"] and ck["optimizer_format"] == "fully_reshardable":
        console.print(f"[bold yellow]warning[/bold yellow]: every save gathers {ck['gather_host_gb']:.0f} GB of optimizer "
                      f"state into DP rank 0's host memory (~{ck['gather_s']:.0f} s over gloo); "
                      "checkpoint.optimizer_format=dp_reshardable (or auto) saves the "
                      "shards where they are and resumes at the same model-parallel layout")


def _render_time(st: Dict[str, Any], console: Console) -> None:
    parts = ", ".join(f"{k} {v:.3g}s" for k, v in st["breakdown_s"].items() if v > 0)
    if st["nominal_rates"]:
        console.print(f"estimated step (nominal CPU rates, for comparing layouts only): {st['step_s']:.3g}s ({parts})")
        return
    tps, sp = st["tokens_per_s_per_gpu"], st["spread"]
    console.print(f"estimated step: {st['step_s']:.3g}s ({parts})")
    console.print(f"throughput: {tps:,.0f} tokens/s/GPU, likely {tps * (1 - sp):,.0f} to {tps * (1 + sp):,.0f} (+/-{sp:.0%}); "
                  f"model MFU {st['model_mfu'] * 100:.0f}% of the bf16 peak")
    if st["ep_blocking_s"] > 0:
        blocking, exposed = st["ep_blocking_s"], st["breakdown_s"]["ep"]
        if st["ep_overlap"]:
            console.print(f"EP all-to-all: {st['ep_transfer_s']:.3g}s per step on the links, {st['ep_hidden_s']:.3g}s of it "
                          f"hidden behind the other micro-batch's computation (combined 1F1B schedule), {exposed:.3g}s "
                          f"exposed ({blocking:.3g}s as blocking exchanges)")
        else:
            console.print(f"EP all-to-all: {blocking:.3g}s per step, all exposed (parallel.overlap_moe_expert_parallel_comm="
                          "true hides part of it behind another micro-batch's computation)")
    dominant = ", ".join(f"{k} {share:.0%}" for k, share in st["dominant"])
    console.print(f"dominant terms: {dominant}; {st['gemm_format']} GEMMs at {st['gemm_efficiency']:.0%} of their peak "
                  "(constants and their sources: estimate/rates.py)")
    for line in st["assumptions"]:
        console.print(f"  assumed: {line}")


def search_rows(result: SearchResult, user_overrides: Sequence[str] = ()) -> List[Dict[str, Any]]:
    rows = []
    for c in result.best:
        p, t = c.cfg.parallel, c.cfg.train
        rows.append({
            "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "sp": p.sp,
            "micro_batch_size": t.micro_batch_size, "recompute": t.recompute,
            "step_s": c.time.total, "tokens_per_s_per_gpu": c.time.tokens_per_s_per_gpu, "model_mfu": c.time.mfu,
            "memory_gb": c.memory.worst.total / GB, "margin_gb": c.memory.margin / GB,
            "bubble_fraction": c.memory.bubble_fraction, "overrides": c.command_overrides(user_overrides),
            "sharding_mode": c.sharding_mode,  # None: the recipe's own; else the mode the search had to add
        })
    return rows


def render_search(result: SearchResult, recipe: str, console: Console, base_overrides: Sequence[str] = ()) -> None:
    rows = search_rows(result, base_overrides)
    console.print(f"searched {result.enumerated} layouts, {result.screened} fit and factorise; "
                  f"showing the {len(rows)} fastest that pass every validation rule")
    if result.rejected:
        top = ", ".join(f"{k} ({n})" for k, n in result.rejected.most_common(4))
        console.print(f"rejected by validation among the fastest: {top}")
    if not rows:
        return
    modes = sorted({r["sharding_mode"] for r in rows if r["sharding_mode"]})
    if modes:
        console.print(f"the recipe's own sharding left too few layouts that fit; also searched: {', '.join(modes)} "
                      "(their commands set it; step times count one parameter all-gather per step, zero3 gathers in forward and backward)")
    t = Table(title="fastest valid layouts (analytic step-time model; see estimate/steptime.py)")
    for col in ("#", "tp", "pp", "vpp", "cp", "ep", "etp", "mbs", "recompute", "step s", "tok/s/GPU", "MFU", "mem GB", "margin", "bubble"):
        t.add_column(col, justify="right")
    for i, r in enumerate(rows, 1):
        t.add_row(str(i), str(r["tp"]), str(r["pp"]), str(r["vpp"] or "-"), str(r["cp"]), str(r["ep"]), str(r["etp"] or "=tp"),
                  str(r["micro_batch_size"]), r["recompute"], f"{r['step_s']:.3g}", f"{r['tokens_per_s_per_gpu']:.0f}",
                  f"{r['model_mfu'] * 100:.0f}%", f"{r['memory_gb']:.1f}", f"{r['margin_gb']:.1f}", f"{r['bubble_fraction'] * 100:.0f}%")
    console.print(t)
    for i, r in enumerate(rows, 1):
        console.print(f"#{i}: megatron-recipes plan {recipe} " + " ".join(r["overrides"]), soft_wrap=True, highlight=False)
