"""SFT data: record forms, exact answer-only masks, first-fit-decreasing packing, packed attention."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from data_support import small_builtin, small_cfg, write_jsonl

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.attention import cu_seqlens, packed_attention_mask, packed_seq_params
from megatron_recipes.data.sft.dataset import build_sft_datasets
from megatron_recipes.data.sft.formats import read_conversations, to_messages
from megatron_recipes.data.sft.packing import first_fit_decreasing
from megatron_recipes.data.sft.render import ChatRenderer
from megatron_recipes.data.sft.templates import resolve_template, shipped_templates, template_text
from megatron_recipes.data.tokenizer import load_tokenizer_dir


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    small_builtin(root)
    return root


@pytest.fixture(scope="module")
def tok(cache_root):
    return load_tokenizer_dir(small_builtin(cache_root).tokenizer_dir)


@pytest.fixture(scope="module")
def special_tok(tok, tmp_path_factory):
    """The same tokenizer with ChatML markers as real special tokens (one id each)."""
    out = tmp_path_factory.mktemp("special")
    hf = load_tokenizer_dir(tok.source).hf
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(str(out))
    return load_tokenizer_dir(out)


def conversation(rng: random.Random, turns: int):
    words = "alpha beta gamma delta import return class yield lambda value index sort".split()
    say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    msgs = [{"role": "system", "content": say(3)}] if rng.random() < 0.5 else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": say(rng.randint(1, 12))}, {"role": "assistant", "content": say(rng.randint(1, 20))}]
    return msgs


def test_record_forms():
    inst = to_messages({"instruction": "Sort", "input": "3 1 2", "output": "1 2 3", "system": "S"}, "f:1")
    assert inst == [{"role": "system", "content": "S"}, {"role": "user", "content": "Sort\n\n3 1 2"}, {"role": "assistant", "content": "1 2 3"}]
    assert to_messages({"input": "q", "output": "a"}, "f:1")[-1] == {"role": "assistant", "content": "a"}
    share = to_messages({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "f:1")
    chat = to_messages({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "f:1")
    assert share == chat == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RecipeError, match="f:3: turn 1 has unknown role 'robot'"):
        to_messages({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}, "f:3")
    with pytest.raises(RecipeError, match="unknown role 'bard'"):
        to_messages({"conversations": [{"from": "bard", "value": "q"}]}, "f:1")
    with pytest.raises(RecipeError, match="unknown record form \\(keys: prompt, response\\)"):
        to_messages({"prompt": "q", "response": "a"}, "f:1")
    with pytest.raises(RecipeError, match="must be text"):
        to_messages({"input": "q", "output": 5}, "f:1")


def test_bad_files(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"input": "q", "output": "a"}\n{"input": "\xff", "output": "a"}\n')
    with pytest.raises(RecipeError, match="bad.jsonl:2: bytes that are not UTF-8"):
        list(read_conversations(str(tmp_path / "bad.jsonl")))
    with pytest.raises(RecipeError, match="does not exist"):
        list(read_conversations(str(tmp_path / "none.jsonl")))


@pytest.mark.parametrize("which", ["plain", "special"])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_answer_mask_is_exact(tok, special_tok, which, template):
    t = tok if which == "plain" else special_tok
    renderer = ChatRenderer(t.hf, template_text(template))
    rng = random.Random(0)
    convs = [(f"c{i}", conversation(rng, rng.randint(1, 3))) for i in range(40)]
    end = "<|im_end|>\n" if template == "chatml" else "<|eot_id|>"
    for (_, msgs), sample in zip(convs, renderer.tokenize(convs)):
        full = t.hf.apply_chat_template(msgs, chat_template=renderer.template, tokenize=False)
        assert t.hf.decode(sample.ids.tolist()) == full  # nothing lost or added
        answers = "".join((m["content"].strip() if template == "llama3" else m["content"]) + end for m in msgs if m["role"] == "assistant")
        assert t.hf.decode(sample.ids[sample.mask].tolist()) == answers  # the mask covers answers only
        # every maximal run of masked tokens is one whole answer
        runs = np.flatnonzero(np.diff(np.concatenate([[0], sample.mask.astype(int), [0]])))
        assert len(runs) // 2 == sum(m["role"] == "assistant" for m in msgs)
    if which == "special" and template == "chatml":
        end_id = t.hf.convert_tokens_to_ids("<|im_end|>")
        sample = renderer.tokenize(convs[:1])[0]
        assert all(sample.mask[np.flatnonzero(sample.ids == end_id)] == [m["role"] == "assistant" for m in convs[0][1]])


def test_templates_resolve(tok):
    assert {"chatml", "llama3"} <= set(shipped_templates())
    assert resolve_template(None, tok.hf, tok.source) == template_text("chatml")  # the built-in tokenizer's own
    with pytest.raises(RecipeError, match="unknown chat template 'vicuna'"):
        template_text("vicuna")
    unstable = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(RecipeError, match="prefix"):
        ChatRenderer(tok.hf, unstable).segments([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "x")


def _reference_ffd(lengths, capacity):
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def test_first_fit_decreasing_matches_reference():
    rng = random.Random(1)
    for _ in range(30):
        capacity = rng.choice([16, 100, 4096])
        lengths = [rng.randint(1, capacity) if rng.random() < 0.2 else rng.randint(1, max(1, capacity // 5)) for _ in range(rng.randint(1, 400))]
        bins = first_fit_decreasing(lengths, capacity)
        assert bins == _reference_ffd(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    with pytest.raises(ValueError):
        first_fit_decreasing([5, 17], 16)


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    records = []
    for i in range(120):
        msgs = conversation(rng, rng.randint(1, 3))
        form = i % 3
        if form == 0:
            records.append({"messages": msgs})
        elif form == 1:
            back = {"system": "system", "user": "human", "assistant": "gpt"}
            records.append({"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in msgs]})
        else:
            records.append({"input": msgs[-2]["content"], "output": msgs[-1]["content"]})
    records.append({"messages": [{"role": "user", "content": "no answer here"}]})  # nothing to learn: dropped
    records.append({"input": "long " * 1000, "output": "tail"})  # too long: truncation cuts the answer off
    records.append({"input": "q", "output": "long " * 1000})  # too long: truncated, keeps part of its answer
    write_jsonl(path, records)
    return path


def _cfg(cache_root, sft_file, *extra):
    return small_cfg(cache_root, "data.kind=sft", f"data.sft_path={sft_file}", "train.seq_length=512", "train.train_iters=2", *extra)


def test_packing_keeps_every_sample_exact(cache_root, sft_file, tok):
    packed, _, _, summ = build_sft_datasets(_cfg(cache_root, sft_file), tok)
    unpacked, _, _, summ_u = build_sft_datasets(_cfg(cache_root, sft_file, "data.packing=false"), tok)
    s, u = summ["train"], summ_u["train"]
    assert (s.samples, s.truncated, s.dropped_no_answer, s.dropped_overlong, s.kept) == (123, 2, 2, 0, 121)
    assert u.kept == 121
    assert s.rows < u.rows == 121 and s.fill > 0.8 and s.loss_tokens == u.loss_tokens > 0
    seen_loss = 0
    for r in range(s.rows):
        row = packed.row(r)
        seg = row["segment_ids"]
        members = packed.rows[r]
        assert set(np.unique(seg)) == set(range(len(members))) | ({-1} if (seg == -1).any() else set())
        assert (seg[seg >= 0] == np.sort(seg[seg >= 0])).all()  # samples are contiguous, in order
        for k, i in enumerate(members):
            sample = packed.samples[i]
            at = np.flatnonzero(seg == k)
            assert (row["tokens"][at] == sample.ids[:-1]).all() and (row["labels"][at] == sample.ids[1:]).all()
            assert (row["loss_mask"][at] == sample.mask[1:]).all()
            assert (row["position_ids"][at] == np.arange(len(at))).all()  # restarts per sample
        assert (row["loss_mask"][seg == -1] == 0).all()
        seen_loss += int(row["loss_mask"].sum())
    assert seen_loss == s.loss_tokens
    # a truncated sample fills a whole row; with overlong_policy=drop it is counted instead
    _, _, _, dropped = build_sft_datasets(_cfg(cache_root, sft_file, "data.overlong_policy=drop"), tok)
    d = dropped["train"]
    assert (d.samples, d.truncated, d.dropped_no_answer, d.dropped_overlong, d.kept) == (123, 0, 1, 2, 120)
    # batches carry segment_ids; the dataset cycles with a new order each epoch
    from megatron_recipes.data.batches import micro_batches

    batch = next(micro_batches(packed, 2, 0, 1))
    assert batch["segment_ids"].dtype == torch.int32 and batch["segment_ids"].shape == (2, 512)
    assert len(packed) == 2 * 16 and torch.equal(packed[0]["tokens"], packed[0]["tokens"])
    assert "segment_ids" not in unpacked[0]


def test_context_parallel_pads_each_sample(cache_root, sft_file, tok):
    train, _, _, _ = build_sft_datasets(_cfg(cache_root, sft_file, "parallel.cp=2"), tok)
    row = train.row(0)
    seg = row["segment_ids"]
    for k in range(len(train.rows[0])):
        assert (seg == k).sum() % 4 == 0  # each sample's span is a multiple of 2 * cp


def test_packed_attention_mask_and_cu_seqlens():
    seg = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 2, 2]], dtype=torch.int32)
    mask = packed_attention_mask(seg)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(6):
            for j in range(6):
                real = seg[b, i] >= 0
                allowed = (seg[b, i] == seg[b, j] and j <= i) if real else i == j
                assert bool(mask[b, 0, i, j]) == (not allowed)
    assert cu_seqlens(seg).tolist() == [0, 3, 5, 6, 7, 10, 12]
    params = packed_seq_params(seg)
    assert params.qkv_format == "thd" and params.max_seqlen_q == 3 and params.cu_seqlens_q.dtype == torch.int32


def test_sft_errors(cache_root, tok, tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        build_sft_datasets(_cfg(cache_root, tmp_path / "none.jsonl"), tok)
    write_jsonl(tmp_path / "robot.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(RecipeError, match="robot.jsonl:1: turn 0 has unknown role 'robot'"):
        build_sft_datasets(_cfg(cache_root, tmp_path / "robot.jsonl"), tok)
    write_jsonl(tmp_path / "long.jsonl", [{"input": "x " * 2000, "output": "y"}])
    with pytest.raises(RecipeError, match="no SFT sample is left"):
        build_sft_datasets(_cfg(cache_root, tmp_path / "long.jsonl", "data.overlong_policy=drop"), tok)


def test_a_turn_with_weight_0_is_not_trained_and_empty_answers_are_counted(cache_root, tok, tmp_path):
    # Before: a per-turn weight 0 was ignored (the turn trained) and empty answers trained as "answer = end of
    # turn" with no count anywhere (issue 30, case 12).
    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "kept answer"},
             {"role": "user", "content": "second"}, {"role": "assistant", "content": "skipped answer", "weight": 0}]
    messages = to_messages({"messages": turns}, "x:1")
    renderer = ChatRenderer(tok.hf, template_text("chatml"))
    (sample,) = renderer.tokenize([("x:1", messages)])
    assert tok.hf.decode(sample.ids[sample.mask].tolist()) == "kept answer<|im_end|>\n"
    unweighted = [{k: v for k, v in t.items() if k != "weight"} for t in turns]
    (both,) = renderer.tokenize([("x:1", to_messages({"messages": unweighted}, "x:1"))])
    assert both.mask.sum() > sample.mask.sum()  # the same conversation without the weight trains both answers
    for index, weight, message in ((3, 2, "has weight 2"), (3, True, "has weight True"), (0, 0, r"\(user\) has a weight")):
        bad = [dict(t, weight=weight) if i == index else t for i, t in enumerate(turns)]
        with pytest.raises(RecipeError, match=message):
            to_messages({"messages": bad}, "x:1")
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"messages": turns}, {"input": "q", "output": ""}, {"input": "q2", "output": "a"}])
    _, _, _, summaries = build_sft_datasets(_cfg(cache_root, path), tok)
    s = summaries["train"]
    assert (s.empty_answers, s.weight_0_turns, s.samples) == (1, 1, 3)
