"""Helpers shared by the launch/Slurm tests: Hydra quoting, plans, and stand-in srun/scontrol."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, List

from megatron_recipes.slurm.launch_plan import build_plan
from megatron_recipes.slurm.script import render_script

REPO = Path(__file__).resolve().parents[1]


def hydra_str(value: str) -> str:
    """A Hydra override value holding any characters (spaces, both kinds of quotes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hydra_list(values: Iterable[str]) -> str:
    return "[" + ",".join(hydra_str(v) for v in values) + "]"


def cpu_overrides(run_dir: Path, *extra: str) -> List[str]:
    """tiny_llama_cpu on the slurm_cpu cluster: 2 nodes x 1 rank, TP=1 so DP=2 spans the nodes."""
    return ["cluster=slurm_cpu", "parallel.tp=1", f"run.dir={hydra_str(str(run_dir))}", *extra]


def render(recipe: str, overrides: List[str], **kw) -> tuple:
    plan = build_plan(recipe, overrides, **kw)
    return plan, render_script(plan)


def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


STUB_SRUN = r"""#!/bin/bash
# records its argv (NUL-separated), then behaves as $STUB_MODE says
printf '%s\0' "$@" > "$STUB_DIR/srun.args"
[ -e "$MEGATRON_RECIPES_PREEMPT_FILE" ] && echo yes > "$STUB_DIR/flag_at_start" || echo no > "$STUB_DIR/flag_at_start"
case "${STUB_MODE:-ok}" in
  ok) exit 0 ;;
  fail) exit 7 ;;
  preempted) echo '{"step": 5}' > "$(dirname "$MEGATRON_RECIPES_PREEMPT_FILE")/preempted.json"; exit 0 ;;
  wait_for_flag)
    touch "$STUB_DIR/started"
    for _ in $(seq 200); do [ -e "$MEGATRON_RECIPES_PREEMPT_FILE" ] && break; sleep 0.05; done
    [ -e "$MEGATRON_RECIPES_PREEMPT_FILE" ] || exit 9
    echo '{"step": 12}' > "$(dirname "$MEGATRON_RECIPES_PREEMPT_FILE")/preempted.json"
    rm -f "$MEGATRON_RECIPES_PREEMPT_FILE"
    exit 0 ;;
esac
"""

STUB_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") [ -n "${STUB_NO_HOSTS:-}" ] || printf 'nodeA\nnodeB\n' ;;
  "requeue "*) echo "$2" >> "$STUB_DIR/requeued" ;;
  *) echo "stub scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""


def stub_slurm_bin(folder: Path) -> Path:
    """A folder with stand-in ``srun`` and ``scontrol`` (put first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_exe(folder / "srun", STUB_SRUN)
    _write_exe(folder / "scontrol", STUB_SCONTROL)
    return folder


def stub_env(stub_dir: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.update(PATH=f"{stub_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", STUB_DIR=str(stub_dir),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[A-B]")
    env.pop("SLURM_RESTART_COUNT", None)
    env.update(extra)
    return env


def read_args(stub_dir: Path) -> List[str]:
    return (stub_dir / "srun.args").read_bytes().decode().split("\0")[:-1]
