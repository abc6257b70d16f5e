"""`megatron-recipes data <preprocess|build-index|builtin> ...`."""

from __future__ import annotations

import json
import sys
from typing import List

from megatron_recipes.cli_args import kv_options, split_args
from megatron_recipes.config.errors import RecipeError

USAGE = """usage:
  megatron-recipes data preprocess input=<files|globs|folder> output_prefix=<path> tokenizer=<dir|builtin>
        [text_key=text] [workers=N] [append_eod=true] [dtype=auto|uint16|int32] [split=train]
        [add_special_tokens=false] [batch_size=1000] [--overwrite] [--quiet] [--json]
        workers = tokenizer threads; an existing output_prefix is replaced only with --overwrite
  megatron-recipes data build-index <recipe> [overrides]   precompute index caches into data.cache_dir
  megatron-recipes data builtin [data.cache_dir=...]       build (or find) the built-in corpus"""

_PREPROCESS_OPTIONS = {
    "input": None,
    "output_prefix": None,
    "tokenizer": None,
    "text_key": "text",
    "workers": "0",
    "append_eod": "true",
    "dtype": "auto",
    "split": "",
    "add_special_tokens": "false",
    "batch_size": "1000",
}


def _bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise RecipeError(f"{name}={value} is not a boolean", fix=f"{name}=true or {name}=false")


def _int(name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise RecipeError(f"{name}={value} is not an integer >= {minimum}", fix=f"e.g. {name}={max(minimum, 1)}")
    return number


def _preprocess(argv: List[str]) -> int:
    from megatron_recipes.data.preprocess import preprocess, print_summary

    args = split_args(argv, "megatron-recipes data preprocess", flags={"quiet": False, "json": False, "overwrite": False}, positional=())
    opts = kv_options(args.overrides, "megatron-recipes data preprocess", _PREPROCESS_OPTIONS)
    summary = preprocess(
        input_spec=opts["input"],
        output_prefix=opts["output_prefix"],
        tokenizer=opts["tokenizer"],
        text_key=opts["text_key"],
        workers=_int("workers", opts["workers"], 0) or None,
        append_eod=_bool("append_eod", opts["append_eod"]),
        dtype=opts["dtype"],
        split=opts["split"] or None,
        add_special_tokens=_bool("add_special_tokens", opts["add_special_tokens"]),
        batch_size=_int("batch_size", opts["batch_size"], 1),
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
    from megatron_recipes.config.schema import DataConfig
    from megatron_recipes.data.builtin import builtin_data_for, describe

    allowed = {"data.cache_dir": "", "data.builtin_max_files": str(DataConfig.builtin_max_files),
               "data.builtin_vocab_size": str(DataConfig.builtin_vocab_size)}
    args = split_args(argv, "megatron-recipes data builtin", positional=())
    opts = kv_options(args.overrides, "megatron-recipes data builtin", allowed)
    data = DataConfig(
        kind="builtin",
        cache_dir=opts["data.cache_dir"] or None,
        builtin_max_files=_int("data.builtin_max_files", opts["data.builtin_max_files"], 1),
        builtin_vocab_size=_int("data.builtin_vocab_size", opts["data.builtin_vocab_size"], 260),
    )
    print(describe(builtin_data_for(data)))
    return 0


COMMANDS = {"preprocess": _preprocess, "build-index": _build_index, "builtin": _builtin}


def main(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown data command '{name}'\n  fix: use one of {', '.join(COMMANDS)}\n{USAGE}", file=sys.stderr)
        return 2
    if rest and rest[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    return COMMANDS[name](rest)
