"""A fine-tuning run's validation answers, generated and scored: what the model says, not what it would
say if it were shown the right answer so far (the trainer's teacher-forced ``task_accuracy``).

Each validation conversation's last assistant turn is the reference; the conversation before it is the
prompt, rendered with the run's chat template (``generate``'s ``PromptMaker``). An answer counts when the
generated text, cut at its end of turn, equals the reference (surrounding whitespace aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig


@dataclass
class Question:
    where: str  # file:line
    history: List[dict]  # the messages before the last user turn
    prompt: str  # the last user turn
    reference: str  # the last assistant turn


def validation_path(cfg: RunConfig) -> str:
    from megatron_recipes.data.sft.builtin_tasks import resolve_paths

    _, valid = resolve_paths(cfg.data.sft_path, cfg.data.sft_valid_path, cfg.data.cache_dir)
    if not valid:
        raise RecipeError(
            "the run names no validation conversations (data.sft_valid_path)",
            fix="pass what=loss, or train with data.sft_valid_path=<valid.jsonl>",
        )
    return valid


def validation_questions(cfg: RunConfig, limit: int) -> List[Question]:
    """The first ``limit`` (0: all) validation conversations that end in a user turn and an answer."""
    from megatron_recipes.data.sft.formats import read_conversations

    path = validation_path(cfg)
    out: List[Question] = []
    for where, messages in read_conversations(path):
        if len(messages) < 2 or messages[-1]["role"] != "assistant" or messages[-2]["role"] != "user":
            continue
        out.append(Question(where, list(messages[:-2]), messages[-2]["content"], messages[-1]["content"]))
        if limit and len(out) == limit:
            break
    if not out:
        raise RecipeError(f"{path} holds no conversation ending in a user turn and an answer", fix="check the validation file")
    return out


def score(questions: Sequence[Question], answers: Sequence) -> Dict:
    """Exact-match accuracy, with each answer kept for reading (``data.prompts.Answer``s in)."""
    records = []
    for q, a in zip(questions, answers):
        records.append({"where": q.where, "prompt": q.prompt, "reference": q.reference, "text": a.text,
                        "correct": a.text.strip() == q.reference.strip(), "finish_reason": a.finish_reason})
    right = sum(r["correct"] for r in records)
    return {"exact_match": right / len(records), "answers": len(records), "right": right, "records": records}
