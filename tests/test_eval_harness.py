"""``eval tasks=``: lm-evaluation-harness on a Megatron checkpoint gives the scores lm-eval's own ``hf`` model
gives the exported HF model, request for request (log-likelihoods, greedy flags, generated answers).

Local tasks over local JSONL (lm_eval_tasks): multiple choice and generation on the fine-tuning run's
validation questions, rolling perplexity on Python source longer than the model's 512 positions (several
windows). The runs are README's order in miniature (finetuned_support); ``eval`` runs as a user runs it.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from finetuned_support import convert, eval_cli, merged_export, readme_lora
from lm_eval_tasks import GENERATION, MULTIPLE_CHOICE, PERPLEXITY, write_tasks

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def tasks(shared_runs, tmp_path_factory):
    from megatron_recipes.data.sft.builtin_tasks import ensure_files

    run = readme_lora(shared_runs)
    _, valid = ensure_files(str(run.cache))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [(stdlib / "textwrap.py").read_text()[:4000], (stdlib / "bisect.py").read_text()[:600]]
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), Path(valid), documents)


def lm_eval_on_export(folder: Path, tasks: Path, names, chat: bool) -> dict:
    """lm-eval as a user runs it on the export: its hf model, float32, on CPU."""
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32,device=cpu", tasks=list(names),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), apply_chat_template=chat, log_samples=True,
    )


def _responses(sample: dict):
    """A sample's responses as numbers/text: [[logprob, greedy], ...] for choices, [logprob] rolling, [text]."""
    return [r[0] if isinstance(r, (list, tuple)) and len(r) == 1 else r for r in sample["resps"]]


def assert_same_scores(ours: dict, theirs: dict, names) -> None:
    for name in names:
        mine, other = ours["results"][name], theirs["results"][name]
        for metric, value in other.items():
            if metric in ("alias", "name") or "_stderr" in metric:
                continue
            assert mine[metric] == pytest.approx(float(value), rel=1e-5), (name, metric, mine, other)
        ours_samples = sorted(ours["samples"][name], key=lambda s: s["doc_id"])
        their_samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(ours_samples) == len(their_samples) > 0
        for a, b in zip(ours_samples, their_samples):
            for x, y in zip(_responses(a), _responses(b)):
                if isinstance(y, str):
                    assert x == y, (name, a["doc_id"], x, y)  # a generated answer
                elif isinstance(y, (list, tuple)):  # (log-likelihood, greedy) of one choice
                    assert float(x[0]) == pytest.approx(float(y[0]), abs=1e-3) and bool(x[1]) == bool(y[1]), (name, x, y)
                else:  # a document's rolling log-likelihood (thousands of nats)
                    assert float(x) == pytest.approx(float(y), rel=1e-6), (name, x, y)


@pytest.mark.slow
def test_fine_tuned_checkpoint_scores_as_lm_eval_on_its_export(shared_runs, tasks):
    """The LoRA run at its saved TP=2, prompts through its chat template: multiple choice and generation."""
    run = readme_lora(shared_runs)
    names = (MULTIPLE_CHOICE, GENERATION)
    result = eval_cli(run, run.lora.run_dir, f"tasks={','.join(names)}", f"include_path={tasks}", "apply_chat_template=true")
    assert result["layout"].startswith("tp=2") and "loss" not in result  # tasks= asks for the tasks alone
    kept = json.loads((run.lora.run_dir / "eval" / f"step_{result['step']:07d}.json").read_text())
    theirs = lm_eval_on_export(merged_export(shared_runs), tasks, names, chat=True)
    assert_same_scores(kept["tasks"], theirs, names)
    assert kept["tasks"]["results"][GENERATION]["exact_match,none"] > 0.5  # the answers were learned, and scored
    page = (run.lora.run_dir / "report.html").read_text()  # eval rewrote the run's report
    assert f"{GENERATION} exact_match" in page[page.index('id="finetuning"'):]


@pytest.mark.slow
def test_base_checkpoint_at_pp2_scores_as_lm_eval_on_its_export(shared_runs, tasks):
    """The pretraining run resharded to PP=2 (the scores cross a pipeline stage), no chat template:
    multiple choice and rolling perplexity over several windows."""
    run = readme_lora(shared_runs)

    def export():
        out = shared_runs.folder("readme-base-export") / "hf"
        done = convert(run, "export", f"ckpt_dir={run.base.run_dir}", f"hf_dir={out}", "--quiet")
        assert done == {"code": 0, "error": None}, done
        return out

    folder = shared_runs.get("readme-base-export", export)
    names = (MULTIPLE_CHOICE, PERPLEXITY)
    result = eval_cli(run, run.base.run_dir, f"tasks={tasks / (MULTIPLE_CHOICE + '.yaml')},{tasks / (PERPLEXITY + '.yaml')}",
                      "parallel.tp=1", "parallel.pp=2")
    assert result["layout"].startswith("tp=1 pp=2")
    kept = json.loads((run.base.run_dir / "eval" / f"step_{result['step']:07d}.json").read_text())
    theirs = lm_eval_on_export(folder, tasks, names, chat=False)
    assert_same_scores(kept["tasks"], theirs, names)
    from transformers import AutoTokenizer

    document = json.loads((tasks / "code.jsonl").read_text().splitlines()[0])["text"]
    assert len(AutoTokenizer.from_pretrained(str(folder))(document)["input_ids"]) > 2 * 512  # several windows scored


def test_task_errors_are_refused_before_any_rank_starts(shared_runs, tasks, tmp_path):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.evaluation.cli import prepare

    run = readme_lora(shared_runs)
    target = str(run.base.run_dir)
    with pytest.raises(RecipeError, match="what=tasks needs tasks="):
        prepare([target, "what=tasks"])
    with pytest.raises(RecipeError, match="missing.yaml does not exist"):
        prepare([target, f"tasks={tmp_path / 'missing.yaml'}"])
    with pytest.raises(RecipeError, match="knows no task no_such_task"):
        prepare([target, "tasks=no_such_task", f"include_path={tasks}"])
    with pytest.raises(RecipeError, match="is not a folder"):
        prepare([target, "tasks=x", f"include_path={tmp_path / 'nowhere'}"])
    plan = prepare([target, f"tasks={MULTIPLE_CHOICE}", f"include_path={tasks}"])
    assert plan.measures == ("tasks",) and plan.tokenizer is not None
