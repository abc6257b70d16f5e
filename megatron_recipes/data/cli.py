"""`megatron-recipes data <preprocess|build-index|builtin> ...`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_recipes.cli_args import MISSING, options, split_args, subcommand
from megatron_recipes.config.schema import DataConfig

USAGE = """usage:
  megatron-recipes data preprocess input=<files|globs|folder> output_prefix=<path> tokenizer=<dir|builtin>
        [text_key=text] [workers=N] [append_eod=true] [dtype=auto|uint16|int32] [split=train]
        [add_special_tokens=false] [batch_size=1000] [--overwrite] [--quiet] [--json]
        workers = tokenizer threads; an existing output_prefix is replaced only with --overwrite
  megatron-recipes data build-index <recipe> [overrides]   precompute index caches into data.cache_dir
  megatron-recipes data builtin [data.cache_dir=...]       build (or find) the built-in corpus"""

@dataclass
class PreprocessOptions:
    input: str = MISSING
    output_prefix: str = MISSING
    tokenizer: str = MISSING
    text_key: str = "text"
    workers: int = field(default=0, metadata={"min": 0})  # 0: one per core
    append_eod: bool = True
    dtype: str = "auto"
    split: Optional[str] = None
    add_special_tokens: bool = False
    batch_size: int = field(default=1000, metadata={"min": 1})


@dataclass
class BuiltinData:
    cache_dir: Optional[str] = None
    builtin_max_files: int = field(default=DataConfig.builtin_max_files, metadata={"min": 1})
    builtin_vocab_size: int = field(default=DataConfig.builtin_vocab_size, metadata={"min": 260})


@dataclass
class BuiltinOptions:
    data: BuiltinData = field(default_factory=BuiltinData)


def _preprocess(argv: List[str]) -> int:
    from megatron_recipes.data.preprocess import preprocess, print_summary

    args = split_args(argv, "megatron-recipes data preprocess", flags={"quiet": False, "json": False, "overwrite": False}, positional=())
    opts = options(args.overrides, "megatron-recipes data preprocess", PreprocessOptions)
    summary = preprocess(
        input_spec=opts.input,
        output_prefix=opts.output_prefix,
        tokenizer=opts.tokenizer,
        text_key=opts.text_key,
        workers=opts.workers or None,
        append_eod=opts.append_eod,
        dtype=opts.dtype,
        split=opts.split or None,
        add_special_tokens=opts.add_special_tokens,
        batch_size=opts.batch_size,
        show_progress=not args.flags.get("quiet"),
        overwrite=bool(args.flags.get("overwrite")),
    )
    if args.flags.get("json"):
        print(json.dumps(summary.as_dict()))
    else:
        print_summary(summary)
    return 0


def _build_index(argv: List[str]) -> int:
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.data.build_index import build_index_caches

    args = split_args(argv, "megatron-recipes data build-index")
    cfg = compose_recipe(args.recipe, args.overrides)
    for line in build_index_caches(cfg):
        print(line)
    return 0


def _builtin(argv: List[str]) -> int:
    from megatron_recipes.data.builtin import builtin_data_for, describe

    args = split_args(argv, "megatron-recipes data builtin", positional=())
    opts = options(args.overrides, "megatron-recipes data builtin", BuiltinOptions).data
    data = DataConfig(
        kind="builtin",
        cache_dir=opts.cache_dir or None,
        builtin_max_files=opts.builtin_max_files,
        builtin_vocab_size=opts.builtin_vocab_size,
    )
    print(describe(builtin_data_for(data)))
    return 0


COMMANDS = {"preprocess": _preprocess, "build-index": _build_index, "builtin": _builtin}


def main(argv: List[str]) -> int:
    picked = subcommand(argv, list(COMMANDS), USAGE, "data command")
    if picked is None:
        return 0
    name, rest = picked
    if rest and rest[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    return COMMANDS[name](rest)
