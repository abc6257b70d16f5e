"""``generate``'s ``key=value`` options and the prompts they name; checked here, before any rank starts.

Typed by ``cli_args.options`` (OmegaConf), like ``convert``'s; imports no torch, so a bad option is
reported in a fraction of a second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_recipes.cli_args import options
from megatron_recipes.config.errors import RecipeError

Dtype = Enum("Dtype", {name: name for name in ("bf16", "fp32")})  # the dtypes a model is generated in
PROMPT_KEYS = ("prompt", "text")  # a JSONL record's prompt, under either name


@dataclass
class Layout:
    """``parallel.*``: the layout to generate at (unset: the checkpoint's own, when it fits this machine)."""

    tp: Optional[int] = field(default=None, metadata={"min": 1})
    pp: Optional[int] = field(default=None, metadata={"min": 1})
    ep: Optional[int] = field(default=None, metadata={"min": 1})
    etp: Optional[int] = field(default=None, metadata={"min": 1})

    def given(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class GenerateOptions:
    max_new_tokens: int = field(default=64, metadata={"min": 1})
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 0.0  # 0: no nucleus filter
    seed: int = 1234
    prompts: Optional[str] = None  # a JSONL file: one {"prompt": ...} per line
    stop: Optional[str] = None  # stop at this text as well as at the end-of-sequence token
    chat: Optional[bool] = None  # apply the chat template (unset: for fine-tuned runs, data.kind=sft)
    tokenizer: Optional[str] = None  # a local HF tokenizer folder (unset: the run's own)
    dtype: Optional[Dtype] = None  # unset: fp32 on the CPU lane, the checkpoint's precision on GPUs
    batch_size: int = field(default=8, metadata={"min": 1})  # prompts run together through the engine
    parallel: Layout = field(default_factory=Layout)


def parse(overrides: Sequence[str], prog: str) -> GenerateOptions:
    """The options, with the rules no single field's type can say."""
    opts = options(overrides, prog, GenerateOptions)
    if opts.temperature < 0:
        raise RecipeError(f"{prog}: temperature={opts.temperature} is negative", fix="use temperature=0 (greedy) or a positive number")
    if opts.top_k < 0:
        raise RecipeError(f"{prog}: top_k={opts.top_k} is negative", fix="use top_k=0 (off) or a positive number")
    if not 0.0 <= opts.top_p <= 1.0:
        raise RecipeError(f"{prog}: top_p={opts.top_p} is outside [0, 1]", fix="use top_p=0 (off) or e.g. top_p=0.9")
    if opts.top_k > 0 and opts.top_p > 0:  # megatron-core's sampler takes one filter or the other
        raise RecipeError(f"{prog}: top_k={opts.top_k} and top_p={opts.top_p} are both set", fix="set one of them, the other to 0")
    if opts.temperature == 0 and (opts.top_k > 1 or opts.top_p > 0):
        raise RecipeError(
            f"{prog}: temperature=0 is greedy decoding, which top_k/top_p do not change",
            fix="set temperature>0 to sample (e.g. temperature=0.8 top_p=0.9), or drop top_k/top_p",
        )
    if opts.stop == "":
        raise RecipeError(f"{prog}: stop= is empty", fix="give the text to stop at, e.g. stop='###'")
    return opts


def read_prompts(path: str) -> List[str]:
    """Prompts of a JSONL file, in order; each line an object with ``prompt`` (or ``text``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise RecipeError(f"prompts={path}: no such file", fix="give a JSONL file with one {\"prompt\": ...} per line")
    out: List[str] = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"prompts={path} line {number}: not JSON ({exc.msg})", fix="write one JSON object per line") from None
        prompt = next((record[k] for k in PROMPT_KEYS if isinstance(record, dict) and k in record), None)
        if not isinstance(prompt, str) or not prompt:
            raise RecipeError(
                f"prompts={path} line {number}: no non-empty \"prompt\" text",
                fix='write {"prompt": "..."} on each line',
            )
        out.append(prompt)
    if not out:
        raise RecipeError(f"prompts={path} holds no prompt", fix="write one {\"prompt\": ...} per line")
    return out


def all_prompts(positional: Sequence[str], opts: GenerateOptions, prog: str) -> List[str]:
    """The command line's prompts, then the file's."""
    prompts = list(positional) + (read_prompts(opts.prompts) if opts.prompts else [])
    if not prompts:
        raise RecipeError(f"{prog}: no prompt", fix=f'usage: {prog} <run dir | checkpoint> "a prompt" (or prompts=<jsonl>)')
    if any(not p for p in prompts):
        raise RecipeError(f"{prog}: an empty prompt", fix="give each prompt some text")
    return prompts
