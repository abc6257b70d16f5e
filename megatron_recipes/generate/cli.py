"""``megatron-recipes generate <run dir | checkpoint> [prompt ...] [key=value ...] [--json]``.

Text from a checkpoint through megatron-core's inference engine, at the checkpoint's layout or another.

options  max_new_tokens=64  temperature=0 (greedy)  top_k=0  top_p=0  seed=1234  stop=<text>
         prompts=<jsonl: one {"prompt": ...} per line>  chat=true|false (default: true for fine-tuned runs)
         tokenizer=<HF tokenizer folder>  dtype=bf16|fp32  batch_size=8
         parallel.tp= parallel.pp= parallel.ep= parallel.etp=  (default: the checkpoint's layout if it fits here)
flags    --json (one JSON record per prompt: prompt, text, tokens, finish_reason)
         --trust-checkpoint (let a checkpoint's pickled objects run code; see SECURITY.md)

A run dir means its latest complete checkpoint; a checkpoints folder its latest; an iter_NNNNNNN folder
itself. Several ranks are started through torchrun (as ``train`` does); rank 0 prints.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.generate import options as opts_mod

PROG = "megatron-recipes generate"
FLAGS = ("json", "trust-checkpoint", "help")
_OPTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=(?!=)")  # key=value; a prompt holding "=" after a space stays a prompt


def split(argv: Sequence[str]) -> Tuple[List[str], List[str], set]:
    """(positional, key=value options, flags), in order; prompts may hold spaces and '='."""
    positional, overrides, flags = [], [], set()
    for item in argv:
        if item.startswith("--"):
            name = item[2:]
            if name not in FLAGS:
                raise RecipeError(f"{PROG}: unknown flag '{item}'", fix=f"accepted flags: {', '.join('--' + f for f in FLAGS)}")
            flags.add(name)
        elif _OPTION.match(item):
            overrides.append(item)
        else:
            positional.append(item)
    return positional, overrides, flags


def checkpoint_of(path: str) -> Path:
    """A run dir's (or checkpoints folder's) latest complete checkpoint, or the checkpoint folder given."""
    return checkpoint.resolve(Path(path))


def layout_for(saved: dict, given: dict):
    """The checkpoint's layout with the given degrees replaced; one rank if unset and it does not fit here."""
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert import layout as layouts
    from megatron_recipes.convert.verify import max_local_ranks

    own = {"tp": int(saved.get("tp") or 1), "pp": int(saved.get("pp") or 1), "ep": int(saved.get("ep") or 1), "etp": saved.get("etp")}
    if "tp" in given and "etp" not in given:
        own["etp"] = None  # the expert TP followed the saved TP; with another TP it follows that one
    layout = ParallelConfig(**{**own, **given})
    world = layouts.min_world_size(layout)
    if world > max_local_ranks():
        if not given:
            return ParallelConfig()
        raise RecipeError(
            f"{PROG}: {layouts.layout_string(layout)} needs {world} local ranks, this machine runs {max_local_ranks()}",
            fix="pass a smaller layout, e.g. parallel.tp=1 parallel.pp=1",
        )
    return layout


def default_dtype(cfg) -> str:
    import torch

    if not torch.cuda.is_available():
        return "fp32"  # the CPU lane: float32 (bf16 matmuls on CPU are slow and round differently)
    return "bf16" if cfg.precision.params_dtype in ("bf16", "fp16") else "fp32"


def prepare(argv: Sequence[str]):
    """Everything every rank needs, checked: (job, prompt maker, prompts, options, flags, the run's recipe)."""
    from megatron_recipes.data.tokenizer import check_fits_model
    from megatron_recipes.generate.engine import Job, Sampling
    from megatron_recipes.data.prompts import PromptMaker, run_tokenizer, wants_chat

    positional, overrides, flags = split(argv)
    if not positional:
        raise RecipeError(f"{PROG}: missing <run dir | checkpoint>", fix=f'usage: {PROG} runs/<name> "a prompt"')
    opts = opts_mod.parse(overrides, PROG)
    prompts = opts_mod.all_prompts(positional[1:], opts, PROG)
    if "trust-checkpoint" in flags:
        os.environ[checkpoint.TRUST_ENV] = "1"
    resolved, cfg, meta = checkpoint.read_run(checkpoint_of(positional[0]))
    layout = layout_for(meta.get("layout") or {}, opts.parallel.given())
    tokenizer = run_tokenizer(cfg, resolved, meta, opts.tokenizer)
    check_fits_model(tokenizer, cfg)
    maker = PromptMaker(tokenizer, cfg, wants_chat(cfg, opts.chat), opts.stop)
    encoded = [maker.encode(p) for p in prompts]
    sampling = Sampling(opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p, opts.seed)
    dtype = opts.dtype.value if opts.dtype is not None else default_dtype(cfg)
    job = Job(str(resolved), layout, dtype, [p.ids for p in encoded], sampling, maker.termination_id, opts.batch_size)
    return job, maker, encoded, opts, flags, cfg


def show(answers, as_json: bool) -> None:
    if as_json:
        for answer in answers:
            print(json.dumps(answer.record(), ensure_ascii=False), flush=True)
        return
    if len(answers) == 1:
        print(answers[0].text, flush=True)
        return
    for number, answer in enumerate(answers, start=1):
        print(f"[{number}] {answer.prompt}\n{answer.text}\n", flush=True)


def run_here(job, maker, encoded, opts, flags) -> int:
    """This process is one rank (or the only one): generate, and print on rank 0."""
    from megatron_recipes.generate.engine import generate_ids
    from megatron_recipes.runtime.distributed import shutdown

    try:
        generated = generate_ids(job, maker.ended)  # every rank's maker judges the same ids alike
    finally:
        shutdown()
    if generated is not None:
        show([maker.answer(p, ids, opts.max_new_tokens) for p, ids in zip(encoded, generated)], "json" in flags)
    return 0


def main(argv: List[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help") or "--help" in argv:
        print(__doc__.strip())
        return 0
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: the engine's bar is noise between answers
    from megatron_recipes.runtime import patches

    patches.apply("process")  # before megatron-core is imported (the dispatcher leaves it to us: --help imports no torch)
    from megatron_recipes.convert import layout as layouts
    from megatron_recipes.runtime.local_launch import spawn_local
    from megatron_recipes.training.cli import quiet_known_warnings, under_launcher

    quiet_known_warnings()
    from megatron_recipes.config.derived import is_moe

    job, maker, encoded, opts, flags, cfg = prepare(argv)
    world = layouts.min_world_size(job.parallel)
    if under_launcher():
        return run_here(job, maker, encoded, opts, flags)
    if world == 1:  # this process is the only rank (its one-rank group takes a port of its own)
        return run_here(job, maker, encoded, opts, flags)
    sys.stdout.flush()
    return spawn_local(argv, world, target=("--module", "megatron_recipes.generate"), tokenizers=True, compiles=is_moe(cfg.model))
