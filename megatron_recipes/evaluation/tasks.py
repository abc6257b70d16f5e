"""``eval tasks=...``: lm-evaluation-harness tasks on the checkpoint (``harness.MegatronLM``), run by rank 0
while the other ranks of the layout follow its request batches.

Task names are lm-eval's (its own tasks, or those in ``include_path=``); a YAML file in ``tasks=`` is read
for its ``task:`` name and its folder searched, as lm-eval's ``--tasks`` takes files. When every named task is
in ``include_path`` lm-eval's own thousands of task files are not indexed (seconds saved, no download).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from megatron_recipes.config.errors import RecipeError

INSTALL = 'pip install "megatron-recipes[eval]"'


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RecipeError("eval tasks= runs lm-evaluation-harness, which is not installed", fix=INSTALL) from None
    try:
        import megatron_recipes.evaluation.harness  # noqa: F401  (the adapter needs lm-eval's 0.4.13 model API)
    except ImportError as exc:
        raise RecipeError(f"the installed lm-eval lacks what the adapter uses ({exc})", fix=f'{INSTALL} (lm-eval>=0.4.13)') from None


def _task_name(path: Path) -> Optional[str]:
    """A task YAML's ``task:`` (lm-eval's tags such as ``!function`` read as nothing: only the name is wanted)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RecipeError(f"tasks: {path} cannot be read as YAML: {exc}", fix="check the task file") from None
    name = config.get("task") if isinstance(config, dict) else None
    return str(name) if name else None


def resolve(tasks: List[str], include_path: Optional[str]) -> Tuple[List[str], List[str]]:
    """(task names, folders to search): YAML files in ``tasks`` become their task name and folder."""
    names, folders = [], [include_path] if include_path else []
    if include_path and not Path(include_path).is_dir():
        raise RecipeError(f"include_path={include_path} is not a folder", fix="point at a folder of lm-eval task YAMLs")
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise RecipeError(f"tasks: {task} does not exist", fix="name an lm-eval task or an existing task YAML")
            name = _task_name(path)
            if name is None:
                raise RecipeError(f"tasks: {task} names no task (its 'task:' key)", fix="add task: <name> to the YAML")
            names.append(name)
            folders.append(str(path.parent))
        else:
            names.append(task)
    return names, list(dict.fromkeys(folders))


def task_manager(names: List[str], folders: List[str]):
    """lm-eval's task index: the given folders alone when they hold every task named."""
    from lm_eval.tasks import TaskManager

    if folders:
        local = TaskManager(include_path=folders, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    manager = TaskManager(include_path=folders or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise RecipeError(f"tasks: lm-eval knows no task {', '.join(unknown)}",
                          fix="check the name (lm-eval ls tasks), or pass include_path=<folder of its YAML>")
    return manager


def maker_for(tokenizer, cfg):
    """A request's stops: the run's (its end of turn for a fine-tuning run) and the request's ``until``
    texts; an ``until`` that is one special token stops at its id (decoded answers skip it)."""
    from megatron_recipes.data.prompts import PromptMaker, wants_chat

    def make(until):
        maker = PromptMaker(tokenizer, cfg, chat=wants_chat(cfg, None)).add_stops(list(until))
        special = set(tokenizer.hf.all_special_ids)
        for text in until:
            ids = tokenizer.hf(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1 and ids[0] in special:
                maker.stop_ids.add(int(ids[0]))
        return maker

    return make


def run_tasks(plan, loaded, tokenizer) -> Optional[Dict[str, Any]]:
    """lm-eval's results on rank 0 (None elsewhere): each task's metrics, and every sample for reading."""
    import torch

    from megatron_recipes.evaluation.harness import MegatronLM, Ranks

    cfg = loaded[0]
    ranks = Ranks(loaded, plan, maker_for(tokenizer, cfg))
    if torch.distributed.get_rank() != 0:
        ranks.follow()
        return None
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable

        names, folders = resolve(plan.opts.task_list(), plan.opts.include_path)
        hf = tokenizer.hf
        if plan.maker is not None and plan.maker.renderer is not None:
            hf.chat_template = plan.maker.renderer.template  # the template the run was fine-tuned with
        model = MegatronLM(ranks, hf, cfg.model.max_position_embeddings, plan.opts.batch_size)
        limit = plan.opts.limit
        out = lm_eval.simple_evaluate(
            model=model, tasks=names, num_fewshot=plan.opts.num_fewshot,
            limit=int(limit) if limit is not None and limit >= 1 else limit,
            task_manager=task_manager(names, folders), apply_chat_template=plan.opts.apply_chat_template, log_samples=True,
        )
    finally:
        ranks.release()
    import json

    samples = json.loads(json.dumps(out.get("samples") or {}, default=handle_non_serializable))
    results = {name: {k: v for k, v in metrics.items() if k != "alias"} for name, metrics in out["results"].items()}
    return {"results": results, "n_samples": out.get("n-samples"), "num_fewshot": out.get("n-shot"),
            "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None, "samples": samples}


def summary_lines(tasks: Dict[str, Any]) -> List[str]:
    lines = []
    for name, metrics in tasks["results"].items():
        shown = [f"{k.split(',')[0]} {v:.4f}" + (f" (±{metrics.get(k.replace(',', '_stderr,', 1)):.4f})"
                                                 if isinstance(metrics.get(k.replace(',', '_stderr,', 1)), float) else "")
                 for k, v in metrics.items() if isinstance(v, (int, float)) and "_stderr" not in k and k != "sample_len"]
        lines.append(f"  {name:<15} {', '.join(shown)}")
    return lines
