"""Command-line values are typed once, in cli_args: argparse for flags, a dataclass (via OmegaConf) for
key=value options. A bad value is a RecipeError (exit 2) naming the argument and a fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import pytest

from megatron_recipes.cli import main as cli
from megatron_recipes.cli_args import MISSING, options, positive_int, split_args
from megatron_recipes.config.errors import RecipeError


class Dtype(Enum):
    bf16 = "bf16"
    fp32 = "fp32"


@dataclass
class Layout:
    tp: Optional[int] = field(default=None, metadata={"min": 1})


@dataclass
class Opts:
    path: str = MISSING
    workers: int = field(default=0, metadata={"min": 0})
    eod: bool = True
    tolerance: float = 1e-4
    dtype: Optional[Dtype] = None
    parallel: Layout = field(default_factory=Layout)


def test_options_are_typed():
    got = options(["path=data/*.jsonl", "workers=3", "eod=no", "tolerance=1e-3", "dtype=bf16", "parallel.tp=2"], "p", Opts)
    assert got == Opts(path="data/*.jsonl", workers=3, eod=False, tolerance=1e-3, dtype=Dtype.bf16, parallel=Layout(tp=2))
    assert options(["path=x", "dtype=null", "parallel.tp=none"], "p", Opts) == Opts(path="x")


@pytest.mark.parametrize("argv, words", [
    (["path=x", "workers=two"], ["p: workers=two is not an integer", "workers=2"]),
    (["path=x", "eod=maybe"], ["eod=maybe is not a boolean", "eod=true"]),
    (["path=x", "tolerance=tight"], ["tolerance=tight is not a number"]),
    (["path=x", "dtype=fp16"], ["dtype=fp16 is not one of bf16, fp32"]),
    (["path=x", "workers=-1"], ["workers=-1 must be >= 0"]),
    (["path=x", "parallel.tp=0"], ["parallel.tp=0 must be >= 1"]),
    (["path=x", "parallel.cp=2"], ["unknown option 'parallel.cp'", "parallel.tp="]),
    (["workers=1"], ["missing required option 'path='", "add path=<value>"]),
])
def test_bad_options_name_the_argument_and_a_fix(argv, words):
    with pytest.raises(RecipeError) as info:
        options(argv, "p", Opts)
    text = info.value.render()
    assert info.value.fix and all(w in text for w in words), text


FLAGS = {"top": positive_int, "rtol": float, "out": True, "json": False}


def test_flags_are_typed_and_overrides_kept_in_order():
    args = split_args(["r", "a=1", "--top", "3", "--rtol=1e-6", "--out", "x=y.png", "--json", "b.c=[1,2]"], "p", FLAGS)
    assert args.positional == ["r"] and args.overrides == ["a=1", "b.c=[1,2]"]
    assert args.flags == {"top": 3, "rtol": 1e-6, "out": "x=y.png", "json": True}
    assert split_args(["r"], "p", FLAGS).flags == {}


@pytest.mark.parametrize("argv, words", [
    (["r", "--top", "0"], ["--top", "'0'"]),
    (["r", "--rtol", "small"], ["--rtol", "'small'"]),
    (["r", "--fast"], ["unknown flag '--fast'", "--top <value>"]),
    (["r", "--out"], ["--out", "expected one argument"]),
    (["r", "extra"], ["unexpected argument 'extra'"]),
    ([], ["missing recipe"]),
])
def test_bad_flags_name_the_argument_and_a_fix(argv, words):
    with pytest.raises(RecipeError) as info:
        split_args(argv, "p", FLAGS)
    text = info.value.render()
    assert info.value.fix and all(w in text for w in words), text


def test_cli_exits_2_on_a_bad_value(capsys):
    assert cli(["plan", "tiny_llama_cpu", "--search", "--top", "none"]) == 2
    err = capsys.readouterr().err
    assert "--top" in err and "'none'" in err and "fix:" in err and "Traceback" not in err
    assert cli(["data", "builtin", "data.builtin_vocab_size=100"]) == 2
    assert "data.builtin_vocab_size=100 must be >= 260" in capsys.readouterr().err
