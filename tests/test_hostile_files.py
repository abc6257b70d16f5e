"""Damaged and odd files get one message, never a traceback (issue 30, case 13): checkpoint paths that are
files or link loops, a meta.json with a bad format_version, blend weights that are not numbers, a log.jsonl
whose last line a kill tore, HF config.json values of the wrong kind, text with lone surrogates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_recipes.checkpoint import _files as store
from megatron_recipes.config.errors import RecipeError


def _file(tmp: Path) -> Path:
    path = tmp / "a_file"
    path.write_text("not a checkpoint")
    return path


def _loop(tmp: Path) -> Path:
    path = tmp / "loop"
    os.symlink(path, path)
    return path


def _meta_version(value):
    def make(tmp: Path) -> Path:
        ckpt = tmp / "iter_0000001"
        ckpt.mkdir()
        (ckpt / store.META).write_text(json.dumps({"format": store.FORMAT, "format_version": value}))
        return ckpt

    return make


CHECKPOINT_PATHS = [
    # (case, make the path, what reads it, the message)
    ("load names a file", _file, store.resolve_dir, "is a file, not a checkpoint folder"),
    ("load names a link loop", _loop, store.resolve_dir, "symbolic link to nothing"),
    ("run.dir/checkpoints is a file", _file, store.latest, "is a file, not a folder"),
    ("run.dir/checkpoints is a link loop", _loop, store.latest, "symbolic link to nothing"),
    ("format_version abc", _meta_version("abc"), store.read_meta, "format_version 'abc', not a whole number"),
    ("format_version null", _meta_version(None), store.read_meta, "format_version None, not a whole number"),
    ("format_version 1.5", _meta_version(1.5), store.read_meta, "format_version 1.5, not a whole number"),
]


@pytest.mark.parametrize("case,make,read,message", CHECKPOINT_PATHS, ids=[c[0] for c in CHECKPOINT_PATHS])
def test_odd_checkpoint_paths_are_one_message(tmp_path, case, make, read, message):
    with pytest.raises(RecipeError, match=message):
        read(make(tmp_path))


@pytest.mark.parametrize("weights", [["inf", "/a", "1", "/b"], ["nan", "/a"], [float("inf"), "/a"], ["-1", "/a"], [0, "/a"]])
def test_blend_weights_must_be_positive_finite_numbers(weights):
    # before: ["inf", /a, "1", /b] passed here and failed with an AssertionError inside megatron-core
    from megatron_recipes.data.pretrain import parse_blend

    with pytest.raises(RecipeError, match="not a positive finite number"):
        parse_blend(weights, "data.blend")
    assert parse_blend(["0.7", "/a", "0.3", "/b"], "data.blend")[1] == [0.7, 0.3]


def test_a_torn_last_log_line_does_not_block_the_resume(tmp_path):
    # before: JSONDecodeError in sinks.truncate_after on every start, so the run could never resume
    from megatron_recipes.training import sinks

    log = tmp_path / "log.jsonl"
    good = [json.dumps({"type": "LOG", "step": s, "data": {"loss": 1.0}}) for s in (1, 2, 3)]
    meta = json.dumps({"type": "METADATA", "metric": "run", "metadata": {}})
    log.write_text("\n".join([meta, *good]) + '\n{"type": "LOG", "st')
    assert [r["step"] for r in sinks.step_records(log)] == [1, 2, 3]
    sinks.truncate_after(log, 2)
    assert log.read_text().splitlines() == [meta, *good[:2]]


HF_VALUES = [
    ({"num_attention_heads": 0}, "num_attention_heads=0: each must be a whole number > 0"),  # was ZeroDivisionError
    ({"hidden_size": -64}, "hidden_size=-64"),  # was accepted
    ({"num_hidden_layers": 1.5}, "num_hidden_layers=1.5"),
    ({"vocab_size": True}, "vocab_size=True"),
    ({"rms_norm_eps": "abc"}, "transformers rejects it: .*rms_norm_eps"),  # was transformers' own traceback
]


@pytest.mark.parametrize("patch,message", HF_VALUES, ids=[next(iter(p)) + "=" + str(next(iter(p.values()))) for p, _ in HF_VALUES])
def test_hf_config_values_of_the_wrong_kind_are_one_message(tmp_path, patch, message):
    from megatron_recipes.convert.importer import read_source

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_source(tmp_path).model.hidden_size == 64  # the intact config reads
    (tmp_path / "config.json").write_text(json.dumps({**config, **patch}))
    with pytest.raises(RecipeError, match=message):
        read_source(tmp_path)


def test_lone_surrogates_are_replaced_and_counted_by_preprocess(tmp_path, data_cache):
    # before: TypeError from the tokenizer ("TextEncodeInput must be ..."), the whole run lost
    from data_support import small_builtin
    from tokenizers import Tokenizer

    from megatron_recipes.data.preprocess import preprocess

    tok_dir = small_builtin(data_cache).tokenizer_dir
    (tmp_path / "in.jsonl").write_text('{"text": "hello \\ud800 world"}\n{"text": "fine"}\n')
    summary = preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), str(tok_dir), workers=2, show_progress=False)
    assert summary.documents == 2 and summary.invalid_unicode == 1
    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    expected = len(tok.encode("hello \ufffd world").ids) + len(tok.encode("fine").ids) + 2  # + EOD each
    assert summary.tokens == expected


def test_a_lone_surrogate_in_an_sft_record_names_the_line(tmp_path):
    from megatron_recipes.data.sft.formats import read_conversations

    path = tmp_path / "train.jsonl"
    path.write_text('{"input": "ok", "output": "fine"}\n{"input": "bad \\udc80", "output": "x"}\n')
    with pytest.raises(RecipeError, match=r":2: 'input' holds a lone UTF-16 surrogate \(\\udc80\)|line 2.*surrogate"):
        list(read_conversations(str(path)))


@pytest.mark.parametrize("entry", ["../outside/evil.safetensors", "/etc/evil.safetensors", "sub/../../evil.safetensors", "..", 7])
def test_a_safetensors_index_never_names_a_file_outside_the_model_folder(tmp_path, entry):
    # before: the shard named by "../outside/evil.safetensors" was opened and read (issue 30, case 15)
    from safetensors.torch import save_file
    import torch

    from megatron_recipes.convert.safetensors_io import INDEX_NAME, shard_files

    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir(), outside.mkdir()
    save_file({"w": torch.zeros(2)}, str(outside / "evil.safetensors"))
    save_file({"v": torch.zeros(2)}, str(model / "model-00001.safetensors"))
    index = {"weight_map": {"v": "model-00001.safetensors", "w": entry}}
    (model / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(RecipeError, match="outside .*never a path"):
        shard_files(model)
    index["weight_map"]["w"] = "model-00001.safetensors"
    (model / INDEX_NAME).write_text(json.dumps(index))
    assert shard_files(model) == [model / "model-00001.safetensors"]


def test_a_checkpoints_folder_that_cannot_be_written_is_refused_before_training(tmp_path, data_cache, capsys):
    # Before: training started and failed only at its first save (issue 30, case 14).
    import subprocess

    from megatron_recipes.cli import main

    blocked = _file(tmp_path) / "run"  # a regular file where a folder must go
    with pytest.raises(RecipeError, match="checkpoints cannot be written to"):
        store.require_writable(blocked / "checkpoints")
    assert main(["train", "tiny_llama_cpu", f"run.dir={blocked}", f"data.cache_dir={data_cache}"]) == 2
    assert "checkpoints cannot be written to" in capsys.readouterr().err
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(readonly)], capture_output=True).returncode:
        pytest.skip("this machine cannot mount a read-only tmpfs (needs root); the file-in-the-way case ran")
    try:
        with pytest.raises(RecipeError, match="Read-only file system"):
            store.require_writable(readonly / "run" / "checkpoints")
    finally:
        subprocess.run(["umount", str(readonly)], check=True)
