"""`plan --picture`: draw nodes, GPUs and their TP / PP / DP / CP / EP groups (PNG, SVG or PDF).

One row per node, one cell per GPU. Fill colour = pipeline stage; a thick outline = one TP group
(joined across nodes of one NVLink domain, dashed red where it leaves the domain); the bar under a cell = its EP group (MoE); the text = rank and
its indices in the DP / CP / EP groups. NVLink domains larger than a node are bracketed on the left.
Readable for 2-16 nodes; bigger worlds draw their first 16 nodes and say how many are left out.
"""

from __future__ import annotations

from pathlib import Path

from megatron_recipes import files
from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.groups import build_group_map, coordinates

MAX_NODES_DRAWN = 16
FORMATS = (".png", ".svg", ".pdf")


def _layout_title(cfg: RunConfig, title: str) -> str:
    p = cfg.parallel
    parts = [f"TP{p.tp}", f"PP{p.pp}" + (f" (VPP{p.vpp})" if p.vpp else ""), f"CP{p.cp}", f"DP{derived.data_parallel_size(cfg)}"]
    if derived.is_moe(cfg.model):
        parts += [f"EP{p.ep}", f"ETP{derived.expert_tensor_parallel_size(cfg)}"]
    c = cfg.cluster
    return f"{title}: {' '.join(parts)} on {c.nodes} x {c.gpus_per_node} {c.name} (world {derived.world_size(cfg)})"


def draw_layout(cfg: RunConfig, out: str, title: str = "layout") -> str:
    """Write the picture to ``out`` atomically (temp file + rename); returns the path."""
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise RecipeError(f"--picture {out}: unsupported format '{path.suffix}'", fix=f"use one of {', '.join(FORMATS)}")
    if not path.parent.exists():
        raise RecipeError(f"--picture {out}: folder {path.parent} does not exist", fix="create it or pick another path")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    groups = build_group_map(cfg)
    coords = coordinates(groups)
    c = cfg.cluster
    gpn, nodes = c.gpus_per_node, min(c.nodes, MAX_NODES_DRAWN)
    fig_w, fig_h = 2.5 + 1.3 * gpn, 1.8 + 0.95 * nodes
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    stage_cmap = plt.get_cmap("tab20" if cfg.parallel.pp > 10 else "tab10")
    ep_cmap = plt.get_cmap("Set2")
    moe = "ep" in groups and groups["ep"].size > 1

    def xy(rank: int):
        return rank % gpn, nodes - 1 - rank // gpn  # node 0 on top

    for n in range(nodes):
        ax.add_patch(Rectangle((-0.1, nodes - 1 - n - 0.12), gpn + 0.2, 0.94, color="0.92", zorder=0))
        ax.text(-0.25, nodes - 1 - n + 0.35, f"node {n}", ha="right", va="center", fontsize=9)
    for rank in range(nodes * gpn):
        x, y = xy(rank)
        stage = coords["pp"][rank]
        ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.7, facecolor=stage_cmap(stage % stage_cmap.N), edgecolor="0.4", lw=0.5, zorder=1))
        label = f"r{rank}\ndp{coords['dp'][rank]}"
        if cfg.parallel.cp > 1:
            label += f" cp{coords['cp'][rank]}"
        if moe:
            label += f"\nep{coords['ep'][rank]}"
            ep_group = next(i for i, g in enumerate(groups["ep"].groups) if rank in g)
            ax.add_patch(Rectangle((x + 0.05, y - 0.08), 0.9, 0.06, color=ep_cmap(ep_group % ep_cmap.N), zorder=1))
        ax.text(x + 0.5, y + 0.35, label, ha="center", va="center", fontsize=7, zorder=3)
    _outline_tp(ax, groups["tp"].groups, xy, nodes * gpn, gpn, c.nvlink_domain, Rectangle)
    _bracket_domains(ax, c, nodes)
    handles = [Patch(color=stage_cmap(s % stage_cmap.N), label=f"PP stage {s}") for s in range(min(cfg.parallel.pp, 20))]
    if groups["tp"].size > 1:
        handles.append(Patch(facecolor="none", edgecolor="black", lw=2, label=f"TP group ({groups['tp'].size} GPUs)"))
        if not groups["tp"].intra_nvlink:
            handles.append(Patch(facecolor="none", edgecolor="red", lw=2, linestyle="--", label="TP group leaving its NVLink domain"))
    if moe:
        handles.append(Patch(color=ep_cmap(0), label=f"EP group bar ({groups['ep'].size} ranks)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    note = f"  (first {nodes} of {c.nodes} nodes)" if c.nodes > nodes else ""
    ax.set_title(_layout_title(cfg, title) + note, fontsize=10)
    ax.set_xlim(-1.6, gpn + 0.3)
    ax.set_ylim(-0.3, nodes)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    try:
        with files.replacing(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lower().lstrip("."), dpi=130, bbox_inches="tight")
    finally:
        plt.close(fig)
    return str(path)


def _outline_tp(ax, tp_groups, xy, drawn: int, gpn: int, domain: int, Rectangle) -> None:
    """One outline per TP group and node it touches (TP groups are contiguous ranks). A group spread over
    nodes of one NVLink domain is joined by a line; one leaving its NVLink domain is dashed red."""
    for g in tp_groups:
        ranks = [r for r in g if r < drawn]
        if not ranks or len(g) == 1:
            continue
        by_node = {}
        for r in ranks:
            by_node.setdefault(r // gpn, []).append(r)
        leaves = len({r // max(1, domain) for r in g}) > 1
        style = dict(edgecolor="red", linestyle="--") if leaves else dict(edgecolor="black", linestyle="-")
        anchors = []
        for members in by_node.values():
            x0, y = xy(min(members))
            ax.add_patch(Rectangle((x0 + 0.02, y - 0.03), len(members) - 0.04, 0.76, fill=False, lw=2.0, zorder=2, **style))
            anchors.append((x0 + len(members) - 0.02, y + 0.35))
        if len(anchors) > 1:
            xs = [max(a[0] for a in anchors) + 0.08] * 2
            ax.plot(xs, [min(a[1] for a in anchors), max(a[1] for a in anchors)], color=style["edgecolor"], lw=2.0,
                    linestyle=style["linestyle"], zorder=2)


def _bracket_domains(ax, cluster, nodes: int) -> None:
    """NVLink domains that span several nodes (NVL72): a bracket left of their rows."""
    per_domain = max(1, cluster.nvlink_domain // max(1, cluster.gpus_per_node))
    if per_domain <= 1:
        return
    for start in range(0, nodes, per_domain):
        end = min(nodes, start + per_domain)
        top, bottom = nodes - start - 0.1, nodes - end - 0.1
        ax.plot([-1.35, -1.35], [bottom + 0.05, top - 0.05], color="tab:purple", lw=2)
        ax.text(-1.45, (top + bottom) / 2, f"NVLink domain {start // per_domain}", rotation=90, ha="right", va="center",
                fontsize=8, color="tab:purple")
