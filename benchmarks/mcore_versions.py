"""The same recipe trained under two interpreters / megatron-core releases: losses and gradient norms side by side.

    python benchmarks/mcore_versions.py --a PYTHON[,PATH...] --b PYTHON[,PATH...] [--recipe tiny_llama_cpu]
        [--steps 20] [override ...]

Each side is an interpreter, optionally followed by folders put first on its PYTHONPATH (a megatron-core
installed with ``pip install --no-deps --target DIR megatron-core==0.16.1`` shadows the interpreter's own),
e.g. ``--a /venv312/bin/python,/opt/mcore016 --b /venv312/bin/python``. Both run this checkout
(``python -m megatron_recipes.cli train``) with one log line per step, each in a fresh run folder, one after
the other. Why: supporting several megatron-core releases is only worth it if a recipe trains the same on
each; on the CPU lane (fp32, deterministic) the figures should agree to the last digit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]


def _side(spec: str) -> Tuple[str, List[str]]:
    python, *paths = spec.split(",")
    return python, paths


def _train(spec: str, recipe: str, steps: int, overrides: List[str], run_dir: Path) -> Dict[str, object]:
    python, paths = _side(spec)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MEGATRON_RECIPES_DIR"] = str(REPO / "recipes")
    cmd = [python, "-m", "megatron_recipes.cli", "train", recipe, f"run.dir={run_dir}",
           f"train.train_iters={steps}", "logging.log_interval=1", *overrides]
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        sys.exit(f"{spec}: training failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    versions, rows = {}, {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "METADATA" and record.get("metric") == "run":
            versions = record["metadata"]["versions"]
        elif record.get("type") == "LOG" and "loss" in record.get("data", {}):
            rows[record["step"]] = (record["data"]["loss"], record["data"]["grad_norm"])
    return {"versions": versions, "rows": rows, "wall": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="PYTHON[,PATH...] of the first side")
    parser.add_argument("--b", required=True, help="PYTHON[,PATH...] of the second side")
    parser.add_argument("--recipe", default="tiny_llama_cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both sides (key=value)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mcore-versions-") as tmp:
        a = _train(args.a, args.recipe, args.steps, args.overrides, Path(tmp) / "a")
        b = _train(args.b, args.recipe, args.steps, args.overrides, Path(tmp) / "b")
    for name, side in (("a", a), ("b", b)):
        v = side["versions"]
        print(f"{name}: python {v.get('python')}, megatron-core {v.get('megatron-core')}, torch {v.get('torch')} "
              f"({side['wall']:.0f} s wall)")
    print(f"{'step':>5} | {'loss a':>18} {'loss b':>18} | {'grad_norm a':>18} {'grad_norm b':>18} | same")
    identical = True
    for step in sorted(set(a["rows"]) | set(b["rows"])):
        (la, ga), (lb, gb) = a["rows"].get(step, (None, None)), b["rows"].get(step, (None, None))
        same = la == lb and ga == gb
        identical &= same
        print(f"{step:>5} | {la!r:>18} {lb!r:>18} | {ga!r:>18} {gb!r:>18} | {'yes' if same else 'NO'}")
    print("bit-identical losses and gradient norms" if identical else "the two sides differ")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
