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
from pathlib import Path
from typing import Dict, List, Optional

from megatron_recipes.cli_args import kv_options, split_args
from megatron_recipes.config.errors import RecipeError

PROG = "megatron-recipes convert"
ACTIONS = ("import", "export", "verify")
_FLAGS = {"verify": False, "no-verify": False, "overwrite": False, "quiet": False, "help": False,
          "trust-checkpoint": False}


def _options(overrides: List[str], prog: str, allowed: Dict[str, Optional[str]]):
    """kv options plus ``parallel.*`` layout options (returned separately)."""
    from megatron_recipes.convert.layout import parse_parallel

    parallel = {o.partition("=")[0]: o.partition("=")[2] for o in overrides if o.startswith("parallel.")}
    rest = [o for o in overrides if not o.startswith("parallel.")]
    return kv_options(rest, prog, allowed), (parse_parallel(parallel, prog) if parallel else None)


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

    prog = f"{PROG} import"
    opts, parallel = _options(overrides, prog, {"hf_dir": None, "out_dir": None, "dtype": ""})
    report = run_import(
        Path(opts["hf_dir"]),
        Path(opts["out_dir"]),
        parallel or ParallelConfig(),
        dtype=opts["dtype"] or None,
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
        run_verify(Path(opts["hf_dir"]), report.checkpoint)
    return 0


def _export(overrides: List[str], flags) -> int:
    from megatron_recipes.convert.exporter import DEFAULT_MAX_SHARD, run_export
    from megatron_recipes.convert.verify import run_verify

    prog = f"{PROG} export"
    opts, parallel = _options(
        overrides, prog, {"ckpt_dir": None, "hf_dir": None, "dtype": "", "hf_assets": "", "max_shard_gb": "", "adapter_only": "false"}
    )
    if parallel is not None:
        raise RecipeError(f"{prog}: export reads any layout; parallel.* options do not apply", fix="drop them")
    try:
        shard = int(float(opts["max_shard_gb"]) * (1 << 30)) if opts["max_shard_gb"] else DEFAULT_MAX_SHARD
    except ValueError:
        raise RecipeError(f"{prog}: max_shard_gb={opts['max_shard_gb']!r} is not a number", fix="e.g. max_shard_gb=5") from None
    if opts["dtype"] and opts["dtype"] not in ("bf16", "fp32"):
        raise RecipeError(f"{prog}: dtype={opts['dtype']} is not supported", fix="use bf16 or fp32")
    from megatron_recipes.peft import export as peft_export  # PEFT checkpoints hold adapters: base + adapters rebuilt

    adapter_only = peft_export.parse_adapter_only(opts["adapter_only"])
    if adapter_only or peft_export.is_peft_checkpoint(Path(opts["ckpt_dir"])):
        return peft_export.cli_export(opts, flags, adapter_only, shard)
    report = run_export(
        Path(opts["ckpt_dir"]),
        Path(opts["hf_dir"]),
        overwrite=bool(flags.get("overwrite")),
        hf_assets=Path(opts["hf_assets"]) if opts["hf_assets"] else None,
        dtype=opts["dtype"] or None,
        max_shard_bytes=shard,
        progress=not flags.get("quiet"),
    )
    print(report.summary())
    params = report.bytes_written // 2
    if _should_verify(flags, params):
        run_verify(report.hf_dir, Path(opts["ckpt_dir"]))
    return 0


def _verify(overrides: List[str], flags) -> int:
    from megatron_recipes.convert.verify import TOLERANCE, run_verify

    prog = f"{PROG} verify"
    opts, parallel = _options(overrides, prog, {"hf_dir": None, "ckpt_dir": None, "tolerance": str(TOLERANCE)})
    try:
        tolerance = float(opts["tolerance"])
    except ValueError:
        raise RecipeError(f"{prog}: tolerance={opts['tolerance']!r} is not a number", fix="e.g. tolerance=1e-4") from None
    run_verify(Path(opts["hf_dir"]), Path(opts["ckpt_dir"]), parallel, tolerance)
    return 0


def _usage() -> str:
    from megatron_recipes.convert.family import all_families

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
        from megatron_recipes.training.checkpoint_trust import TRUST_ENV

        os.environ[TRUST_ENV] = "1"
    return handler(args.overrides, args.flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
