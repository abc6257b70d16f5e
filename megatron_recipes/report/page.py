"""The report page: sections of plain HTML with inline CSS, SVG charts and the layout picture as a PNG data URI.

No script, no external stylesheet, font or image: the file opens the same from a laptop, a cluster's
login node or an e-mail attachment.
"""

from __future__ import annotations

import base64
import statistics
from datetime import datetime
from html import escape
from typing import Any, Iterable, List, Optional, Sequence

from megatron_recipes.report.charts import fmt, line_chart
from megatron_recipes.report.collect import RunData

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d232a;background:#f6f7f9}
header{background:#1d232a;color:#fff;padding:14px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c9d1d9;font-size:14px}nav{padding:8px 28px;background:#e8ebef;font-size:14px}
nav a{margin-right:14px;color:#0b4f8a;text-decoration:none}main{padding:8px 28px 40px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;margin:16px 0;padding:8px 18px 16px}
h2{font-size:18px;margin:10px 0}table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #dde1e6;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f0f2f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}pre{background:#f6f8fa;padding:10px;font-size:12px;overflow:auto}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff;border:1px solid #eef0f3}
.chart .title{font-size:14px;font-weight:600;text-anchor:middle}.chart .empty{font-size:13px;fill:#888;text-anchor:middle}
.chart .plot{fill:#fcfcfd;stroke:#c9ced6}.chart .grid{stroke:#e6e9ee}.chart .ytick{font-size:11px;text-anchor:end;fill:#555}
.chart .xtick{font-size:11px;text-anchor:middle;fill:#555}.chart .xlabel,.chart .ylabel{font-size:12px;text-anchor:middle;fill:#333}
.chart .series{fill:none;stroke-width:2}.chart .baseline{stroke:#888;stroke-dasharray:5 4}.chart .legend{font-size:11px}
.ok{color:#2a7d3f;font-weight:600}.bad{color:#b3261e;font-weight:600}.note{color:#555;font-size:13px}
img.layout{max-width:100%;border:1px solid #eef0f3}
"""

SECTIONS = (("summary", "Summary"), ("curves", "Curves"), ("finetuning", "Fine-tuning and evaluation"),
            ("plan", "Plan"), ("layout", "Ranks and nodes"),
            ("checkpoints", "Checkpoints"), ("restarts", "Starts, restarts and preemptions"),
            ("versions", "Versions"), ("recipe", "Resolved recipe"))


def table(rows: Iterable[Sequence[Any]], head: Optional[Sequence[str]] = None) -> str:
    def cell(v: Any, tag: str = "td") -> str:
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else (fmt(v) if isinstance(v, float) else str(v))
        return f'<{tag}{" class=num" if num else ""}>{escape(text)}</{tag}>'

    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>")
    out.extend("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return "".join(out) + "</table>"


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def _status(run: RunData) -> str:
    total = run.cfg.train.train_iters if run.cfg else None
    if run.preempted:
        return f"preempted at step {run.preempted.get('step')} (waiting for a requeue)"
    if total is not None and run.last_step >= total:
        return "finished"
    return f"in progress or stopped (last logged step {run.last_step})"


def summary(run: RunData) -> str:
    total = run.cfg.train.train_iters if run.cfg else "?"
    rows: List[Sequence[Any]] = [("status", _status(run)), ("steps logged", f"{run.last_step} of {total}")]
    for key, label in (("loss", "train loss (first -> last logged)"), ("val_loss", "validation loss (first -> last)")):
        s = run.series(key)
        if s:
            rows.append((label, f"{s[0][1]:.4f} -> {s[-1][1]:.4f} nats/token"))
    times = [v for _, v in run.series("step_time_s")]
    if times:
        rows.append(("median step time", f"{statistics.median(times) * 1000:.0f} ms"))
    if run.starts:
        layouts = {s.get("layout", "?") for s in run.starts}
        rows.append(("layout", run.starts[-1].get("layout", "?") if len(layouts) == 1 else "; ".join(
            f"{s.get('layout', '?')} from step {s.get('start_step', '?')}" for s in run.starts)))
        rows.append(("world size", run.starts[-1].get("world_size", "?")))
    if run.config_error:
        rows.append(("config.yaml", f"could not be read: {run.config_error}"))
    return table(rows)


def curves(run: RunData) -> str:
    entropy = run.starts[-1].get("unigram_entropy_nats") if run.starts else None  # what a context-blind model reaches
    mtp = sorted({k for r in run.records for k in r["data"] if k.startswith("mtp_") and k.endswith("_loss")})
    charts = [
        line_chart("loss", [("train loss", run.series("loss")), ("validation loss", run.series("val_loss")),
                            *((f"MTP {k[4:-5]} loss (train)", run.series(k)) for k in mtp)], "nats/token",
                   ("unigram entropy", entropy) if isinstance(entropy, (int, float)) else None),
        *([line_chart("task accuracy", [("validation answers, teacher-forced", run.series("task_accuracy"))], "share")]
          if run.series("task_accuracy") else []),
        line_chart("learning rate", [("lr", run.series("lr"))], "lr"),
        line_chart("gradient norm", [("grad norm", run.series("grad_norm"))], "L2 norm"),
        line_chart("throughput", [("tokens/s", run.series("tokens_per_sec"))], "tokens/s (all ranks)"),
        line_chart("memory", [("peak, max over ranks", run.series("peak_mem_gib"))], "GiB"),
        line_chart("step time", [("step time", run.series("step_time_s"))], "seconds"),
    ]
    return f'<div class="charts">{"".join(charts)}</div>'


def _measured_peak(run: RunData) -> Optional[float]:
    values = [v for _, v in run.series("peak_mem_gib")]
    return max(values) if values else None


def plan(run: RunData) -> str:
    if run.plan is None:
        return f'<p class="note">no plan: {escape(run.plan_error or "config.yaml is missing")}</p>'
    p = run.plan
    lay = p["layout"]
    keys = ("world_size", "nodes", "gpus_per_node", "tp", "pp", "vpp", "cp", "dp", "sp", "ep", "etp", "micro_batch_size",
            "global_batch_size", "num_microbatches", "seq_length", "recompute", "recompute_modules", "layers_per_stage")
    body = [f'<p>{escape(p["model"]["name"])}: {p["model"]["params"]:,} parameters on {escape(p["cluster"]["name"])} '
            f'({escape(str(p["cluster"]["gpu_arch"]))}, {p["cluster"]["gpu_memory_gb"]} GB per device)</p>']
    body.append(table([(k, str(lay[k])) for k in keys if k in lay], ("layout", "value")))
    groups = [(k, g["size"], g["count"], "yes" if g["intra_node"] else "no", " ".join(str(x) for x in g["groups"][:3]))
              for k, g in p["groups"].items()]
    body.append(table(groups, ("group kind", "size", "groups", "inside one node", "first groups (ranks)")))
    mem = p["memory"]
    measured = _measured_peak(run)
    cpu = any(s.get("cpu_lane") for s in run.starts)
    what = "peak resident memory of a rank process (CPU lane: includes the Python runtime)" if cpu else "peak allocated device memory"
    rows = [("estimate, worst pipeline stage (per device)", f'{mem["worst_total_gb"]:.3f} GB'),
            ("device capacity", f'{mem["capacity_gb"]:.1f} GB'),
            ("estimate fits", "yes" if mem["fits"] else "no"),
            (f"measured: {what}, max over ranks", f"{measured * 2**30 / 1e9:.3f} GB" if measured is not None else "not logged yet")]
    body.append("<h3>Memory: estimate against measured peak</h3>" + table(rows))
    stages = [(s["pp_rank"], s["params"], s["weights_gb"], s["grads_gb"], s["optimizer_gb"], s["activations_gb"], s["total_gb"])
              for s in mem["stages"]]
    body.append(table(stages, ("PP stage", "params", "weights GB", "grads GB", "optimizer GB", "activations GB", "total GB")))
    st = p["step_time"]
    times = [v for _, v in run.series("step_time_s")]
    measured_t = f"{statistics.median(times):.3f} s" if times else "not logged yet"
    body.append(table([("estimated step time (at the cluster's nominal rates)", f'{st["step_s"]:.3f} s'),
                       ("measured median step time", measured_t)]))
    return "".join(body)


def layout(run: RunData) -> str:
    if run.picture_png is None:
        return f'<p class="note">no picture: {escape(run.plan_error or run.picture_note or "config.yaml is missing")}</p>'
    data = base64.b64encode(run.picture_png).decode("ascii")
    ranks = run.plan["ranks"] if run.plan else []
    kinds = [k for k in ("tp", "pp", "dp", "cp", "ep") if ranks and k in ranks[0]]
    rows = [[r["rank"], r["node"], *(r[k] for k in kinds)] for r in ranks]
    return (f'<img class="layout" alt="ranks on nodes" src="data:image/png;base64,{data}">'
            + table(rows, ["rank", "node", *(f"{k} index" for k in kinds)]))


def checkpoints(run: RunData) -> str:
    if not run.checkpoints:
        return '<p class="note">no checkpoint in this run directory</p>'
    rows = [(c.step, c.path.name, "complete" if c.complete else "incomplete (interrupted save)", f"{c.size_bytes / 2**20:.1f} MiB")
            for c in run.checkpoints]
    return table(rows, ("step", "folder", "state", "size"))


def restarts(run: RunData) -> str:
    if not run.starts:
        return '<p class="note">no start recorded yet</p>'
    rows = [(i + 1, s.get("datetime", "?"), s.get("start_step", "?"), s.get("layout", "?"), s.get("host", "?"),
             s.get("slurm_job_id") or "-", s.get("slurm_restart_count", "-"))
            for i, s in enumerate(run.starts)]
    body = table(rows, ("start", "time", "from step", "layout", "host", "Slurm job", "Slurm restart count"))
    resumed = sum(1 for s in run.starts if s.get("start_step", 0))
    body += f"<p>{len(run.starts)} start(s); {resumed} resumed from a checkpoint (after a preemption, a requeue or a stop).</p>"
    if run.preempted:
        body += "<p class=bad>last stop: preempted</p>" + table(sorted(run.preempted.items()))
    return body


def versions(run: RunData) -> str:
    recorded = run.starts[-1].get("versions") if run.starts else None
    if not recorded:
        return '<p class="note">the run did not record its versions</p>'
    return table(sorted(recorded.items()), ("package", "version (last start)"))


def recipe(run: RunData) -> str:
    if not run.config_text:
        return '<p class="note">config.yaml is missing</p>'
    return f"<details open><summary>config.yaml</summary><pre>{escape(run.config_text)}</pre></details>"


def render(run: RunData) -> str:
    from megatron_recipes.report.finetuning import finetuning

    builders = {"summary": summary, "curves": curves, "finetuning": finetuning, "plan": plan, "layout": layout, "checkpoints": checkpoints,
                "restarts": restarts, "versions": versions, "recipe": recipe}
    name = run.cfg.run.name if run.cfg else run.run_dir.name
    nav = "".join(f'<a href="#{sid}">{escape(title)}</a>' for sid, title in SECTIONS)
    body = "".join(_section(sid, title, builders[sid](run)) for sid, title in SECTIONS)
    when = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(name)}: run report</title>'
        f"<style>{CSS}</style></head><body><header><h1>{escape(name)}</h1>"
        f"<p>{escape(str(run.run_dir))} &middot; report written {when}</p></header><nav>{nav}</nav><main>{body}</main></body></html>\n"
    )


