"""``parallel.pipeline_layout``: megatron-core's ``pipeline_model_parallel_layout`` string, read without torch.

Why read it here: the planner (memory, step time), the rule table and ``check`` must know which stage holds
which layer before a process starts, on a laptop without megatron-core. The grammar is megatron-core's
(``PipelineParallelLayerLayout.parse_str_to_list``; tests/test_pipeline_split.py compares the two on every
form): stages separated by ``|`` in virtual-stage order (every PP rank's first chunk, then every rank's
second...), ``E`` the embedding, ``t`` a decoder layer, ``m`` an MTP layer, ``L`` the loss, ``x*n`` and
``(...)*n`` repeat, commas are cosmetic. DeepSeek-V3's 61 layers on PP=16 x VPP=2: ``Et|(tt|)*30mL``.

The rules (``problems``) are megatron-core's own checks (``validate_layer_layout``, read at 0.16.1) plus what
its users found deadlocks or drops layers without an error (Megatron-LM #1852: empty stages).
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

KINDS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss"}
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")


def stages(layout: str) -> List[str]:
    """Each virtual stage's layers, one character per layer, in megatron-core's stage order."""
    text = layout.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _REPEAT):
        text = pattern.sub(lambda match: match.group(1) * int(match.group(2)), text)
    return text.split("|")


def grid(layout: str, pp: int) -> List[List[str]]:
    """``[pp_rank][vp_stage]`` -> that chunk's layers (stage ``v * pp + rank``, as megatron-core places them)."""
    flat = stages(layout)
    vpp = len(flat) // pp
    return [[flat[v * pp + rank] for v in range(vpp)] for rank in range(pp)]


def decoder_ranges(layout: str, pp: int) -> List[List[range]]:
    """Global decoder-layer indices per ``[pp_rank][vp_stage]`` (layers are numbered in stage order)."""
    by_rank = grid(layout, pp)
    vpp = len(by_rank[0]) if by_rank else 1
    out = [[range(0)] * vpp for _ in range(pp)]
    offset = 0
    for v in range(vpp):
        for rank in range(pp):
            n = by_rank[rank][v].count("t")
            out[rank][v] = range(offset, offset + n)
            offset += n
    return out


def mtp_stage(layout: str, pp: int) -> Optional[Tuple[int, int]]:
    """(pipeline rank, virtual stage) of the stage holding the MTP layers (None without them)."""
    index = next((i for i, stage in enumerate(stages(layout)) if "m" in stage), None)
    return None if index is None else (index % pp, index // pp)


def mtp_rank(layout: str, pp: int) -> Optional[int]:
    """The pipeline rank that holds the MTP layers (None without them)."""
    where = mtp_stage(layout, pp)
    return None if where is None else where[0]


def problems(layout: str, pp: int, vpp: Optional[int], num_layers: int, mtp_layers: Optional[int]) -> List[str]:
    """Why megatron-core would refuse ``layout``, or the run would hang or lose layers (empty list: fine)."""
    flat = stages(layout)
    unknown = sorted({c for stage in flat for c in stage if c not in KINDS})
    if unknown:
        return [f"unknown layer character(s) {', '.join(map(repr, unknown))} (known: "
                + ", ".join(f"{c} {name}" for c, name in KINDS.items()) + "; | separates stages, x*n repeats)"]
    found = []
    if len(flat) % pp:
        return [f"{len(flat)} stages do not divide over parallel.pp={pp} (one stage per PP rank and virtual stage)"]
    stages_per_rank = len(flat) // pp
    if stages_per_rank != (vpp or 1):
        found.append(f"{len(flat)} stages over parallel.pp={pp} make {stages_per_rank} virtual stage(s) per rank, but "
                     f"parallel.vpp={vpp} (set parallel.vpp={'null' if stages_per_rank == 1 else stages_per_rank})")
    joined = "".join(flat)
    if joined.count("E") != 1 or not flat[0].startswith("E"):
        found.append("the embedding (E) must appear exactly once, first in the first stage")
    if joined.count("L") != 1 or not flat[-1].endswith("L"):
        found.append("the loss (L) must appear exactly once, last in the last stage")
    if joined.count("t") != num_layers:
        found.append(f"it places {joined.count('t')} decoder layers (t), model.num_layers={num_layers}")
    mtp = mtp_layers or 0
    if joined.count("m") != mtp:
        found.append(f"it places {joined.count('m')} MTP layers (m), model.mtp_num_layers={mtp_layers}")
    if "m" in joined:
        if "t" in joined[joined.index("m"):]:
            found.append("every decoder layer (t) must come before the MTP layers (m)")
        holding = [i for i, stage in enumerate(flat) if "m" in stage]
        if len(holding) != 1:
            found.append("all MTP layers (m) must be in one stage")
        elif holding[0] // pp != stages_per_rank - 1:
            found.append("the MTP layers (m) must be in their rank's last virtual stage")
        elif holding[0] % pp == 0 and pp > 1 and stages_per_rank > 1:
            found.append("the MTP layers (m) cannot be on the first pipeline rank with virtual stages")
    empty = [i for i, stage in enumerate(flat) if not stage]
    if empty:
        found.append(f"stage(s) {', '.join(map(str, empty))} hold nothing (an empty pipeline stage hangs the schedule, "
                     "Megatron-LM #1852): give each stage at least one layer, or fewer stages")
    return found


def _capped(stage: str, cap: Optional[int]) -> str:
    """``stage`` with at most ``cap`` decoder layers (at least one where it had any), its other layers kept."""
    n = stage.count("t")
    if not n:
        return stage
    keep = n if cap is None else max(1, min(n, cap))
    return stage[: stage.index("t")] + "t" * keep + stage[stage.rindex("t") + 1:]


def standalone_mtp(layout: str, pp: int) -> bool:
    """The MTP layers on a rank before the last (megatron-core's ``mtp_standalone``: every pipeline exchange
    then sends its tensor's shape first)."""
    rank = mtp_rank(layout, pp)
    return rank is not None and rank != pp - 1


def shrink(layout: str, pp: int, new_pp: int, cap: Optional[int], merge_closing: bool = False) -> str:
    """The layout of a shrunk proof (``check``) on ``new_pp`` ranks with the same virtual stages per rank:
    the layout's first stage, its closing stages that hold no decoder layer (MTP alone, the loss alone) kept
    as stages of their own, and middle stages like its most common one holding at most ``cap`` decoder layers
    (the first and last stages as written, as the uneven split fields are kept). Where the closing stages cannot stay apart on fewer ranks, they share the last stage."""
    flat = stages(layout)
    total = len(flat) // pp * new_pp
    mtp = "".join(flat).count("m")
    if total == 1:
        return "E" + _capped("t" * "".join(flat).count("t"), cap) + "m" * mtp + "L"
    tail = []
    while len(flat) - len(tail) > 1 and "t" not in flat[len(flat) - 1 - len(tail)]:
        tail.insert(0, flat[len(flat) - 1 - len(tail)])
    body = flat[: len(flat) - len(tail)]
    middle = body[1:] or ["t"]
    typical = max(sorted(set(middle)), key=middle.count)

    def build(closing: List[str]) -> List[str]:
        last = [] if closing else [body[-1]]
        fill = total - 1 - len(closing) - len(last)
        return [body[0]] + [_capped(typical, cap)] * max(0, fill) + last + closing

    out = build(["".join(tail)] if merge_closing and tail else tail)
    new_layers = "".join(out).count("t")
    if len(out) != total or problems("|".join(out), new_pp, None if total == new_pp else total // new_pp, new_layers, mtp or None):
        merged = build(["".join(tail)]) if tail else out
        out = merged if len(merged) == total else out
    return "|".join(out)
