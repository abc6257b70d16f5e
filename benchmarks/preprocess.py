"""`megatron-recipes data preprocess` vs Megatron-LM's own `tools/preprocess_data.py`, side by side.

Both tools run as separate processes, alternating, in one invocation, on the same JSON-lines corpus
(whole standard-library ``.py`` files of this Python, repeated up to the size asked for; no
downloads), the same byte-level BPE tokenizer folder (8,192 tokens, trained locally by the built-in
data pipeline unless --tokenizer is given), the same number of workers, EOD appended. For each tool it
prints the median wall time, CPU seconds (the process tree's user+sys, comparable when other jobs share
the cores), and two memory peaks: the largest single process (its own VmHWM) and the whole process
tree (sum of the tree's RSS, sampled every 20 ms). The outputs must hold identical tokens.

The baseline is Megatron-LM itself when --megatron-lm points at a checkout of it. It imports its own
``megatron`` package from there, which needs ``triton`` importable and, on Python < 3.12,
``typing.override`` (this script supplies it from ``typing_extensions`` through a small runner);
install triton into a separate environment and pass its interpreter with --megatron-lm-python if you
do not want it in this one. Without a checkout, a self-made fallback (a multiprocessing Pool of
per-document transformers calls feeding megatron-core's builder, the same structure) is used and
labelled as such: it is not the real tool.

    python benchmarks/preprocess.py --megatron-lm ~/src/Megatron-LM --megatron-lm-python ~/mlm-venv/bin/python
    python benchmarks/preprocess.py --mb 1024 --runs 1 --no-baseline        # scale: throughput, flat memory
    python benchmarks/preprocess.py --forms jsonl,parquet,disk --no-baseline  # what each input form costs
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

_RUNNER = (
    "import runpy, sys, typing\n"
    "if not hasattr(typing, 'override'):\n"
    "    import typing_extensions; typing.override = typing_extensions.override\n"
    "tool = sys.argv[1]; sys.argv = sys.argv[1:]\n"
    "runpy.run_path(tool, run_name='__main__')\n"
)


def build_corpus(path: Path, mib: float) -> int:
    """JSON lines, one whole standard-library .py file per document (sorted), repeated up to ``mib``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    target, written, docs = mib * 2**20, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for name in files:
                try:
                    text = name.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                line = json.dumps({"text": text, "source": str(name.relative_to(root))}) + "\n"
                out.write(line)
                written, docs = written + len(line.encode("utf-8")), docs + 1
                if written >= target:
                    break
    return docs


class TreeMonitor:
    """Peak memory of a process and its descendants: largest process (VmHWM) and whole tree (sum of RSS)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.largest, self.tree, self._stop = pid, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children(self):
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    @staticmethod
    def _status(pid: int):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
            return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return 0, 0

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for proc in self._children():
                rss, hwm = self._status(proc.pid)
                total += rss
                self.largest = max(self.largest, hwm)
            self.tree = max(self.tree, total)
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def timed(cmd, env=None, cwd=None) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds of its whole tree, and memory peaks."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    monitor = TreeMonitor(proc.pid)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    monitor.stop()
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{err[-3000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall": wall, "cpu": cpu, "largest": monitor.largest, "tree": monitor.tree, "stdout": out}


def ours_cmd(inp: str, prefix: str, tok: str, workers: int):
    return [sys.executable, "-m", "megatron_recipes.cli", "data", "preprocess", f"input={inp}", f"output_prefix={prefix}",
            f"tokenizer={tok}", f"workers={workers}", "--overwrite", "--quiet", "--json"]


def megatron_cmd(args, inp: str, prefix: str, tok: str):
    tool = str(Path(args.megatron_lm) / "tools" / "preprocess_data.py")
    return [args.megatron_lm_python, "-c", _RUNNER, tool, "--input", inp, "--output-prefix", prefix,
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, "--workers", str(args.workers),
            "--append-eod", "--log-interval", "100000"]


def fallback_cmd(inp: str, prefix: str, tok: str, workers: int):
    return [sys.executable, str(Path(__file__).with_name("preprocess_fallback.py")), inp, prefix, tok, str(workers)]


def _read(prefix: str):
    """(tokens, sequence lengths, document indices) of a .bin/.idx pair, read with NumPy alone."""
    import struct

    import numpy as np

    from megatron_recipes.data.idx_writer import DTYPE_CODES

    raw = Path(prefix + ".idx").read_bytes()
    _, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    dtype = {v: k for k, v in DTYPE_CODES.items()}[code]
    lengths = np.frombuffer(raw, np.int32, n_seq, 34)
    docs = np.frombuffer(raw, np.int64, n_doc, 34 + 12 * n_seq)
    return np.fromfile(prefix + ".bin", dtype), lengths, docs


def same_tokens(a: str, b: str) -> str:
    """How two outputs compare: byte-identical, the same tokens and sequences, or different."""
    if all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx")):
        return "yes (.bin and .idx byte-identical)"
    import numpy as np

    (ta, la, da), (tb, lb, db) = _read(a), _read(b)
    if ta.dtype == tb.dtype and np_equal(ta, tb) and np_equal(la, lb) and np_equal(np.unique(da), np.unique(db)):
        return (f"yes (.bin byte-identical, same {len(la):,} sequences; document indices differ: "
                f"{len(da) - 1:,} vs {len(db) - 1:,} documents, the extra ones empty: no sequence)")
    return "NO"


def np_equal(x, y) -> bool:
    return x.shape == y.shape and bool((x == y).all())


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def report(name: str, runs, size_mib: float) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu")}
    largest, tree = max(r["largest"] for r in runs), max(r["tree"] for r in runs)
    walls = ", ".join(f"{r['wall']:.1f}" for r in runs)
    print(f"  {name:<44} wall {med['wall']:6.2f} s [{walls}]  {size_mib / med['wall']:5.2f} MiB/s  "
          f"cpu {med['cpu']:6.2f} s  peak largest {mib(largest)}  tree {mib(tree)}", flush=True)
    return {**med, "largest": largest, "tree": tree}


def tokenizer_dir(args, work: Path) -> str:
    if args.tokenizer:
        return args.tokenizer
    from megatron_recipes.config.schema import DataConfig
    from megatron_recipes.data.builtin import builtin_data_for

    data = DataConfig(kind="builtin", cache_dir=str(work / "cache"), builtin_max_files=100000, builtin_vocab_size=8192)
    return str(builtin_data_for(data).tokenizer_dir)


def write_forms(corpus: Path, forms, work: Path) -> dict:
    """The corpus as Parquet and as a save_to_disk folder (same documents, same order)."""
    paths = {"jsonl": str(corpus)}
    if {"parquet", "disk"} & set(forms):
        import pyarrow.json as pj
        import pyarrow.parquet as pq

        table = pj.read_json(str(corpus)).select(["text"])
        if "parquet" in forms:
            paths["parquet"] = str(work / "corpus.parquet")
            pq.write_table(table, paths["parquet"])
        if "disk" in forms:
            from datasets import Dataset

            paths["disk"] = str(work / "corpus_disk")
            Dataset(table).save_to_disk(paths["disk"])
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=31.2, help="corpus size in MiB of JSON lines (default 31.2)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="runs per tool, alternating (medians reported)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: built-in BPE, 8,192 tokens)")
    parser.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout: run its tools/preprocess_data.py "
                        "(needs triton importable; typing.override is back-ported here)")
    parser.add_argument("--megatron-lm-python", default=sys.executable, help="interpreter for the Megatron-LM tool")
    parser.add_argument("--no-baseline", action="store_true", help="measure only megatron-recipes")
    parser.add_argument("--forms", default="jsonl", help="input forms for megatron-recipes: jsonl,parquet,disk")
    parser.add_argument("--keep", default=None, help="folder for the corpus, tokenizer and outputs (reused)")
    args = parser.parse_args()

    work = Path(args.keep or tempfile.mkdtemp(prefix="preprocess-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus_{args.mb:g}MiB.jsonl"
    if not corpus.exists():
        build_corpus(corpus, args.mb)
    size = corpus.stat().st_size / 2**20
    docs = sum(1 for _ in open(corpus, "rb"))
    tok = tokenizer_dir(args, work)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    paths = write_forms(corpus, forms, work)
    if args.no_baseline:
        base_name, base_cmd = None, None
    elif args.megatron_lm:
        base_name = "Megatron-LM tools/preprocess_data.py"
        base_cmd = megatron_cmd(args, str(corpus), str(work / "megatron"), tok)
    else:
        base_name = "FALLBACK self-made baseline (not Megatron-LM)"
        base_cmd = fallback_cmd(str(corpus), str(work / "megatron"), tok, args.workers)
    print(f"corpus: {size:.1f} MiB, {docs:,} documents; tokenizer: {tok}; workers: {args.workers}; runs: {args.runs}; "
          f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)

    results = {name: [] for name in ([base_name] if base_name else []) + [f"megatron-recipes ({f})" for f in forms]}
    for i in range(args.runs):
        order = list(results)
        order = order if i % 2 == 0 else order[::-1]
        for name in order:
            if name == base_name:  # the checkout's own megatron package first (the tool appends it last)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.megatron_lm, os.environ.get("PYTHONPATH")]))}
                results[name].append(timed(base_cmd, env=env if args.megatron_lm else None, cwd=str(work)))
            else:
                form = name.split("(")[1].rstrip(")")
                results[name].append(timed(ours_cmd(paths[form], str(work / f"ours_{form}"), tok, args.workers)))
            print(f"    run {i + 1}: {name}: {results[name][-1]['wall']:.1f} s", flush=True)

    print(f"results (median of {args.runs}; peaks are the maximum over runs; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    summary = {name: report(name, runs, size) for name, runs in results.items()}
    tokens = json.loads(results[f"megatron-recipes ({forms[0]})"][-1]["stdout"].strip().splitlines()[-1])["tokens"]
    print(f"  tokens: {tokens:,}; throughput {tokens / summary[f'megatron-recipes ({forms[0]})']['wall']:,.0f} tokens/s")
    ok = True
    for form in forms[1:]:
        same = same_tokens(str(work / "ours_jsonl"), str(work / f"ours_{form}"))
        print(f"  {form} output holds the same tokens as the JSON-lines output: {same}")
        ok &= same.startswith("yes")
    if base_name:
        ours = summary[f"megatron-recipes ({forms[0]})"]
        base = summary[base_name]
        same = same_tokens(str(work / "megatron_text_document"), str(work / f"ours_{forms[0]}"))
        print(f"  tokens identical to the baseline's: {same}")
        print(f"  speed-up (baseline wall / ours): {base['wall'] / ours['wall']:.2f}x  (goal >= 1.5x); "
              f"cpu-time ratio {base['cpu'] / ours['cpu']:.2f}x")
        print(f"  memory, ours / baseline: largest process {ours['largest'] / base['largest']:.2f}, "
              f"whole tree {ours['tree'] / base['tree']:.2f}  (goal <= 1)")
        ok &= same.startswith("yes")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
