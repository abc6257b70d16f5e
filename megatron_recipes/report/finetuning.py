"""The report's fine-tuning and evaluation section: what was adapted and how much trained, the task
accuracy the log recorded, and every evaluation ``megatron-recipes eval`` kept for the run."""

from __future__ import annotations

from html import escape
from typing import List, Sequence

from megatron_recipes.report.collect import RunData


def _peft_rows(run: RunData) -> List[Sequence[str]]:
    cfg = run.cfg
    if cfg is None or cfg.peft.method in (None, "", "none"):
        return []
    p = cfg.peft
    rows = [("method", p.method), ("base", str(cfg.checkpoint.pretrained)), ("rank, alpha", f"{p.rank}, {p.alpha:g}"),
            ("target modules", ", ".join(p.target_modules) if p.target_modules else "(the method's default)")]
    if p.modules_to_save:
        rows.append(("trained whole (modules_to_save)", ", ".join(p.modules_to_save)))
    recorded = next((s["peft"] for s in reversed(run.starts) if isinstance(s.get("peft"), dict)), None)
    if recorded:
        rows.append(("trainable parameters", f"{recorded['trainable']:,} of {recorded['total']:,} "
                                             f"({100.0 * recorded['trainable'] / max(recorded['total'], 1):.4f}%)"))
    return rows


def _task_scores(tasks: dict) -> str:
    """lm-eval's headline metrics of an evaluation, ``task metric value`` each."""
    parts = []
    for name, metrics in (tasks.get("results") or {}).items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and "_stderr" not in key and key != "sample_len":
                parts.append(f"{name} {key.split(',')[0]} {value:.4g}")
    return "; ".join(parts) or "-"


def _evaluations(run: RunData) -> str:
    from megatron_recipes.report.page import table

    rows = []
    for e in run.evaluations:
        loss, answers = e.get("loss") or {}, e.get("answers") or {}
        rows.append((e["step"], e.get("layout", "?"),
                     f"{loss['val_loss']:.4f}" if "val_loss" in loss else "-",
                     f"{loss['perplexity']:.3f}" if "perplexity" in loss else "-",
                     f"{answers['exact_match']:.1%} of {answers['answers']}" if "exact_match" in answers else "-",
                     _task_scores(e["tasks"]) if e.get("tasks") else "-"))
    return table(rows, ("step", "layout", "held-out loss", "perplexity", "generated answers exact", "lm-eval tasks"))


def finetuning(run: RunData) -> str:
    from megatron_recipes.report.page import table

    body = []
    peft = _peft_rows(run)
    if peft:
        body.append(table(peft, ("adapters", "")))
    accuracy = run.series("task_accuracy")
    if accuracy:
        body.append(f"<p>task accuracy (validation answers reproduced exactly, teacher-forced): "
                    f"{accuracy[0][1]:.1%} at step {accuracy[0][0]} -&gt; {accuracy[-1][1]:.1%} at step {accuracy[-1][0]}</p>")
    if run.evaluations:
        body.append("<h3>Evaluations (megatron-recipes eval)</h3>" + _evaluations(run))
    if not body:
        name = escape(run.cfg.run.name) if run.cfg else "this run"
        return f'<p class="note">{name} is not a fine-tuning run and has no evaluation yet '\
               f'(<code>megatron-recipes eval {escape(str(run.run_dir))}</code>)</p>'
    return "".join(body)
