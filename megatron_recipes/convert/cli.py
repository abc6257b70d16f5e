"""``megatron-recipes convert import|export|verify ...``: HF <-> megatron-recipes checkpoints.

import  hf_dir=<HF folder> out_dir=<new folder> [parallel.tp= parallel.pp= parallel.ep= parallel.etp= parallel.vpp=]
        [dtype=bf16|fp32] [--verify | --no-verify] [--overwrite] [--quiet]
export  ckpt_dir=<checkpoint or checkpoints root> hf_dir=<new folder> [dtype=bf16|fp32] [hf_assets=<HF folder>]
        [max_shard_gb=5] [adapter_only=false] [--verify | --no-verify] [--overwrite] [--quiet]
        (a PEFT run's checkpoint exports merged weights, or with adapter_only=true an HF PEFT adapter folder)
verify  hf_dir=<HF folder> ckpt_dir=<checkpoint> [parallel.*=...] [tolerance=1e-4]

Checkpoints are read without running code from them; --trust-checkpoint lifts that for a checkpoint you
trust whose files hold other pickled objects (see SECURITY.md).

import and export compare logits against the HF side automatically for models up to 500M parameters
(``--verify`` forces it, ``--no-verify`` skips it); verify exits non-zero beyond the tolerance.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import List, Optional

from megatron_recipes import checkpoint
from megatron_recipes.cli_args import MISSING, options, split_args
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.convert.layout import DTYPES

PROG = "megatron-recipes convert"
ACTIONS = ("import", "export", "verify")
_FLAGS = {"verify": False, "no-verify": False, "overwrite": False, "quiet": False, "help": False,
          "trust-checkpoint": False}


Dtype = Enum("Dtype", {name: name for name in DTYPES})  # the dtypes a conversion writes


@dataclass
class Layout:
    """``parallel.*`` options: a target layout (unset degrees keep ``ParallelConfig``'s defaults)."""

    tp: Optional[int] = field(default=None, metadata={"min": 1})
    pp: Optional[int] = field(default=None, metadata={"min": 1})
    ep: Optional[int] = field(default=None, metadata={"min": 1})
    etp: Optional[int] = field(default=None, metadata={"min": 1})
    vpp: Optional[int] = field(default=None, metadata={"min": 1})

    def parallel(self):
        """The ParallelConfig these options give, or None when none was set."""
        from megatron_recipes.config.schema import ParallelConfig

        given = {k: v for k, v in asdict(self).items() if v is not None}
        return ParallelConfig(**given) if given else None


@dataclass
class ImportOptions:
    hf_dir: str = MISSING
    out_dir: str = MISSING
    dtype: Optional[Dtype] = None
    parallel: Layout = field(default_factory=Layout)


@dataclass
class ExportOptions:
    ckpt_dir: str = MISSING
    hf_dir: str = MISSING
    dtype: Optional[Dtype] = None
    hf_assets: Optional[str] = None
    max_shard_gb: Optional[float] = None
    adapter_only: bool = False


@dataclass
class VerifyOptions:
    hf_dir: str = MISSING
    ckpt_dir: str = MISSING
    tolerance: float = field(default_factory=lambda: _default_tolerance())
    parallel: Layout = field(default_factory=Layout)


def _default_tolerance() -> float:
    from megatron_recipes.convert.verify import TOLERANCE  # imports torch: only when verify runs

    return TOLERANCE


def _dtype(value: Optional[Dtype]) -> Optional[str]:
    return value.value if value is not None else None


def _should_verify(flags, params: int) -> bool:
    from megatron_recipes.convert.verify import SMALL_MODEL_PARAMS

    if flags.get("verify") and flags.get("no-verify"):
        raise RecipeError("--verify and --no-verify contradict each other", fix="pass one of them")
    if flags.get("verify"):
        return True
    if flags.get("no-verify"):
        return False
    if params > SMALL_MODEL_PARAMS:
        print(f"skipping the logits check for a {params / 1e9:.1f}B-parameter model (pass --verify to run it)")
        return False
    return True


def _import(overrides: List[str], flags) -> int:
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.importer import run_import, train_command
    from megatron_recipes.convert.verify import run_verify

    opts = options(overrides, f"{PROG} import", ImportOptions)
    report = run_import(
        Path(opts.hf_dir),
        Path(opts.out_dir),
        opts.parallel.parallel() or ParallelConfig(),
        dtype=_dtype(opts.dtype),
        overwrite=bool(flags.get("overwrite")),
        progress=not flags.get("quiet"),
    )
    print(report.summary())
    for note in report.notes:
        print(f"note: {note}")
    print(f"recipe model: {report.out_dir / 'model' / (report.cfg.model.name + '.yaml')}; train from it with:")
    print(f"  {train_command(report.out_dir, report.cfg.model.name)}")
    params = report.bytes_written // (2 if report.cfg.precision.params_dtype == "bf16" else 4)
    if _should_verify(flags, params):
        run_verify(Path(opts.hf_dir), report.checkpoint)
    return 0


def _export(overrides: List[str], flags) -> int:
    from megatron_recipes.convert.exporter import DEFAULT_MAX_SHARD, run_export
    from megatron_recipes.convert.verify import run_verify

    prog = f"{PROG} export"
    if any(o.startswith("parallel.") for o in overrides):
        raise RecipeError(f"{prog}: export reads any layout; parallel.* options do not apply", fix="drop them")
    opts = options(overrides, prog, ExportOptions)
    shard = int(opts.max_shard_gb * (1 << 30)) if opts.max_shard_gb else DEFAULT_MAX_SHARD
    from megatron_recipes.convert import peft_export  # PEFT checkpoints hold adapters: base + adapters rebuilt

    if opts.adapter_only or peft_export.is_peft_checkpoint(Path(opts.ckpt_dir)):
        paths = {"ckpt_dir": opts.ckpt_dir, "hf_dir": opts.hf_dir, "hf_assets": opts.hf_assets, "dtype": _dtype(opts.dtype)}
        return peft_export.cli_export(paths, flags, opts.adapter_only, shard)
    report = run_export(
        Path(opts.ckpt_dir),
        Path(opts.hf_dir),
        overwrite=bool(flags.get("overwrite")),
        hf_assets=Path(opts.hf_assets) if opts.hf_assets else None,
        dtype=_dtype(opts.dtype),
        max_shard_bytes=shard,
        progress=not flags.get("quiet"),
    )
    print(report.summary())
    params = report.bytes_written // 2
    if _should_verify(flags, params):
        run_verify(report.hf_dir, Path(opts.ckpt_dir))
    return 0


def _verify(overrides: List[str], flags) -> int:
    from megatron_recipes.convert.verify import run_verify

    opts = options(overrides, f"{PROG} verify", VerifyOptions)
    run_verify(Path(opts.hf_dir), Path(opts.ckpt_dir), opts.parallel.parallel(), opts.tolerance)
    return 0


def _usage() -> str:
    from megatron_recipes.families import all_families

    lines = [__doc__.strip(), "", "families:"]
    for fam in sorted(all_families().values(), key=lambda f: f.name):
        lines.append(f"  {fam.name:<12} {', '.join(fam.architectures)}" + (f"  ({fam.notes})" if fam.notes else ""))
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    args = split_args(argv, PROG, flags=_FLAGS, positional=("action",))
    if args.flags.get("help"):
        print(_usage())
        return 0
    action = args.positional[0]
    if action not in ACTIONS:
        raise RecipeError(f"{PROG}: unknown action '{action}'", fix=f"use one of: {', '.join(ACTIONS)}")
    handler = {"import": _import, "export": _export, "verify": _verify}[action]
    if action == "verify" and (args.flags.get("overwrite") or args.flags.get("no-verify")):
        raise RecipeError(f"{PROG} verify takes no --overwrite/--no-verify", fix="drop the flag")
    if args.flags.get("trust-checkpoint"):  # let its pickled objects run code: only for checkpoints you trust
        os.environ[checkpoint.TRUST_ENV] = "1"
    return handler(args.overrides, args.flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
