"""Local lm-evaluation-harness tasks (no download): the built-in chat task's validation questions as a
multiple-choice task and as a generation task, and Python source as a rolling-perplexity task."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_recipes.data.sft.builtin_tasks import TYPES

MULTIPLE_CHOICE, GENERATION, PERPLEXITY = "types_mc", "types_gen", "code_ppl"

def _metric(name: str, aggregation: str = "mean", higher_is_better: bool = True) -> str:
    return f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {str(higher_is_better).lower()}\n"


_COMMON = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
_TASKS = {
    MULTIPLE_CHOICE: "output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\n"
                     f"doc_to_choice: {json.dumps(list(TYPES))}\ndoc_to_target: label\n"
                     "metric_list:\n" + _metric("acc") + _metric("acc_norm"),
    GENERATION: "output_type: generate_until\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_target: \"{{{{answer}}}}\"\n"
                "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n" + _metric("exact_match"),
    PERPLEXITY: "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{{{text}}}}\"\n"
                "metric_list:\n" + _metric("word_perplexity", "weighted_perplexity", False)
                + _metric("byte_perplexity", "weighted_perplexity", False) + _metric("bits_per_byte", "bits_per_byte", False),
}


def write_tasks(folder: Path, valid_jsonl: Path, documents: list, questions: int = 24) -> Path:
    """The three task YAMLs and their JSONL files in ``folder`` (lm-eval's include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for line in valid_jsonl.read_text(encoding="utf-8").splitlines()[:questions]:
        messages = json.loads(line)["messages"]
        question, answer = messages[-2]["content"], messages[-1]["content"]
        rows.append({"question": question, "answer": answer, "label": TYPES.index(answer)})
    (folder / "types.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    for task, body in _TASKS.items():
        data = folder / ("code.jsonl" if task == PERPLEXITY else "types.jsonl")
        (folder / f"{task}.yaml").write_text(f"task: {task}\n" + _COMMON.format(data=data) + body.format(), encoding="utf-8")
    return folder
