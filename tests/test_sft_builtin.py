"""Zero-setup fine-tuning: the built-in chat tasks, the task accuracy the trainer logs, and the error
that tells a user to run the main job first."""

from __future__ import annotations

import ast
import json
import math

import pytest
import torch

from finetuned_support import readme_lora
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.sft import builtin_tasks
from megatron_recipes.training import step


def _literal(question: str) -> str:
    """The literal a generated question asks about, found from the wordings."""
    for wording in builtin_tasks.WORDINGS:
        head, tail = wording.split("{}")
        if question.startswith(head) and question.endswith(tail):
            return question[len(head): len(question) - len(tail)]
    raise AssertionError(f"no wording matches {question!r}")


def test_records_are_deterministic_and_answers_are_pythons_own():
    a, b = builtin_tasks.records(7, 600), builtin_tasks.records(7, 600)
    assert a == b and a != builtin_tasks.records(8, 600)
    answers = []
    for r in a:
        question, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        assert answer == type(ast.literal_eval(_literal(question))).__name__, question
        assert answer not in question  # the prompt never names its answer
        answers.append(answer)
    # no class prior: every type is about 1/6 of the answers (a constant guess is right ~17% of the time,
    # never with probability > 1/2, so it scores 0 on the strict metric)
    assert sorted(set(answers)) == sorted(builtin_tasks.TYPES)
    assert max(answers.count(t) for t in builtin_tasks.TYPES) / len(answers) < 0.22, answers


def test_no_validation_literal_is_seen_in_training():
    train = builtin_tasks.records(1, builtin_tasks.TRAIN_SAMPLES)
    valid = builtin_tasks.records(2, builtin_tasks.VALID_SAMPLES, valid=True)
    seen = {_literal(r["messages"][0]["content"]) for r in train}
    assert not {_literal(r["messages"][0]["content"]) for r in valid} & seen
    # ... while every type and every wording is trained (the split tests new literals, not a new answer)
    assert {r["messages"][1]["content"] for r in valid} == {r["messages"][1]["content"] for r in train}
    for wording in builtin_tasks.WORDINGS:
        head = wording.split("{}")[0]
        assert any(r["messages"][0]["content"].startswith(head) for r in train)


def test_builtin_files_written_once_with_a_validation_split(tmp_path):
    train, valid = builtin_tasks.resolve_paths("builtin", None, str(tmp_path))
    lines = open(train).read().splitlines()
    assert len(lines) == builtin_tasks.TRAIN_SAMPLES and "messages" in json.loads(lines[0])
    assert valid and len(open(valid).read().splitlines()) == builtin_tasks.VALID_SAMPLES
    assert builtin_tasks.resolve_paths("my.jsonl", None, str(tmp_path)) == ("my.jsonl", None)
    assert builtin_tasks.resolve_paths("builtin", None, str(tmp_path)) == (train, valid)


def test_a_changed_generator_gets_new_files(tmp_path, monkeypatch):
    """The cache key is the generated content: a generator edit cannot reuse the files of the old one."""
    train, _ = builtin_tasks.resolve_paths("builtin", None, str(tmp_path))
    monkeypatch.setattr(builtin_tasks, "WORDINGS", ("Shout the type of {}",) * 3)
    changed, _ = builtin_tasks.resolve_paths("builtin", None, str(tmp_path))
    assert changed != train and "Shout" in open(changed).read() and "Shout" not in open(train).read()


def test_answer_counts_runs_of_answer_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 1, 1, 1]])
    low, high = 0.1, 2.0
    loss = torch.full(mask.shape, high)
    loss[0, 1] = loss[0, 2] = low  # answer 1 right
    loss[0, 5] = high  # answer 2 wrong
    loss[1, 0] = low  # answer 3: one of two tokens wrong
    loss[1, 3:] = low  # answer 4 right
    assert step.answer_counts(mask, loss).tolist() == [2.0, 4.0]
    assert step.answer_counts(mask, torch.full(mask.shape, math.log(2) - 1e-3)).tolist() == [4.0, 4.0]


def test_missing_main_job_checkpoint_says_run_it_first(tmp_path, monkeypatch):
    from megatron_recipes.training.loop import preflight

    monkeypatch.chdir(tmp_path)
    cfg = compose_recipe("tiny_llama_lora", [f"data.cache_dir={tmp_path}", f"run.dir={tmp_path / 'lora'}"])
    with pytest.raises(RecipeError) as info:
        preflight(cfg)
    assert "runs/tiny_llama_cpu/checkpoints" in info.value.message
    assert "megatron-recipes train tiny_llama_cpu" in (info.value.fix or "")


@pytest.mark.slow
def test_lora_after_the_main_job_logs_rising_task_accuracy(shared_runs):
    """The README's order in miniature (finetuned_support): the accuracy logged at step 0 and after
    training must rise."""
    lora = readme_lora(shared_runs).lora
    acc = lora.series("task_accuracy")
    steps = [r["step"] for r in lora.records() if "task_accuracy" in r["data"]]
    assert steps and steps[0] == 0 and len(acc) >= 3, lora.output[-3000:]
    assert acc[-1] > acc[0], acc
