"""Run the real trainer (``python -m megatron_recipes.train``, which starts its own torchrun ranks) in tests.

Each run is a subprocess exactly as a user starts it; the per-step numbers come back from the run's
``log.jsonl``. Runs share one small built-in corpus per test session (``cache_dir``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_recipes.training.sinks import step_records


# Adam that steps like plain SGD (beta1 0, eps far above sqrt(v): update = lr * grad / eps = grad / 10):
# it needs the optimizer state a real run checkpoints, without amplifying float rounding as Adam does.
ADAM_AS_SGD = [
    "optimizer=adam",
    "optimizer.lr=1000.0",
    "optimizer.min_lr=1000.0",
    "optimizer.adam_beta1=0.0",
    "optimizer.adam_eps=10000.0",
    "optimizer.weight_decay=0.0",
    "optimizer.clip_grad=0.0",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr_decay_style=constant",
    "optimizer.use_distributed_optimizer=true",
]

# A tiny corpus (seconds to build), short sequences, per-step logging, no evaluation unless asked.
SMALL_DATA = ["data.builtin_max_files=80", "data.builtin_vocab_size=600"]
FAST = [
    "train.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "logging.log_interval=1",
    "logging.eval_interval=1000",
    "logging.eval_iters=0",
    "logging.plot=false",
    "logging.tensorboard=false",
]


@dataclass
class Run:
    returncode: int
    output: str
    run_dir: Path

    def records(self) -> List[Dict]:
        return step_records(self.run_dir / "log.jsonl")

    def series(self, key: str) -> List[float]:
        """Per-step values of one metric (steps that logged it), in step order."""
        return [r["data"][key] for r in self.records() if key in r["data"]]

    def check(self) -> "Run":
        if self.returncode != 0:
            raise AssertionError(f"training failed with exit code {self.returncode}:\n{self.output[-6000:]}")
        return self


def command(run_dir: Path, cache_dir: Path, overrides: Sequence[str], nproc: int, recipe: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "megatron_recipes.train",
        recipe,
        f"run.dir={run_dir}",
        f"data.cache_dir={cache_dir}",
        f"cluster.gpus_per_node={nproc}",
        f"cluster.nvlink_domain={nproc}",
        *SMALL_DATA,
        *overrides,
    ]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}
    # The trainer starts its own ranks; a rendezvous left in this process's environment (other tests'
    # one-rank groups) must not leak into them.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    return env


def train(
    run_dir: Path,
    cache_dir: Path,
    *overrides: str,
    nproc: int = 1,
    recipe: str = "tiny_llama_cpu",
    timeout: float = 600.0,
    env: Optional[Dict[str, str]] = None,
    self_spawn: bool = False,
) -> Run:
    """The trainer's ranks (``python -m megatron_recipes.train <recipe> ...`` each, under a launcher's
    environment when ``nproc`` > 1) forked from the session's preloaded server; never raises on failure.

    ``self_spawn`` runs ``python -m megatron_recipes.train`` as a user does instead: the launcher process that
    validates once and starts its own ranks (the local launcher's own tests use it), forked from the same server
    (tests/cli_support.py).
    """
    from cli_support import run_module

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(run_dir, cache_dir, overrides, nproc, recipe)
    if not self_spawn:
        return _forked(run_dir, cmd, nproc, timeout, env)
    proc = run_module(cmd[2], cmd[3:], timeout=timeout, env=_env(env), cwd=str(run_dir.parent))
    return Run(proc.returncode, proc.stdout + proc.stderr, Path(run_dir))


def _forked(run_dir: Path, cmd: List[str], nproc: int, timeout: float, env: Optional[Dict[str, str]]) -> Run:
    """The ranks of ``python -m megatron_recipes.train ...`` forked from the session's preloaded server, with
    the environment a launcher gives them (as ``check`` starts its runs: runtime/ranks.py): the same entry and
    trainer as under torchrun, without paying the imports of torch and megatron-core again per process."""
    import tempfile

    from megatron_recipes.runtime import ranks

    fd, log = tempfile.mkstemp(prefix="train-", suffix=".log")
    os.close(fd)
    try:
        job = ranks.start(tuple(cmd[1:3]), cmd[3:], _env(env), log, nproc, cwd=str(run_dir.parent), tokenizers=True,
                          compiles=True)  # the session's one server (tests/multiproc.py's): fine-tuning and MoE runs too
        try:
            code = job.wait(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            raise
        return Run(code, Path(log).read_text(encoding="utf-8", errors="replace"), Path(run_dir))
    finally:
        os.unlink(log)


def start(run_dir: Path, cache_dir: Path, *overrides: str, nproc: int = 1, recipe: str = "tiny_llama_cpu") -> subprocess.Popen:
    """The same command as ``train`` in the background, in its own session (for tests that kill it)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        command(run_dir, cache_dir, overrides, nproc, recipe),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=str(run_dir.parent),
        start_new_session=True,
    )


def relative_diffs(a: Sequence[float], b: Sequence[float]) -> List[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def _save_initial_weights(recipe: str, overrides: Sequence[str], root: str) -> str:
    """(one rank) Build the recipe's model as the trainer does and save its weights as step 0."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed
    from megatron_recipes import checkpoint
    from megatron_recipes.training import optim

    cfg = compose_recipe(recipe, list(overrides))
    distributed.init_model_parallel(cfg)
    model = optim.wrap_model(cfg, build_model_chunks(cfg))
    return str(checkpoint.save(Path(root), 0, model, None, None, {"step": 0}, cfg, keep_last=0))


def initial_weights(root: Path, cache_dir: Path, *overrides: str, recipe: str = "tiny_llama_cpu") -> Path:
    """A weights-only step-0 checkpoint of the single-rank model: every layout starts from it.

    Pipeline stages build different subsets of layers, so each layout's own initialisation differs;
    loading one saved starting point (megatron-core dist-checkpointing reshards it) makes them equal.
    """
    from multiproc import run_ranks

    full = [f"run.dir={root.parent}", f"data.cache_dir={cache_dir}", "cluster.gpus_per_node=1", *SMALL_DATA, *overrides]
    return Path(run_ranks(_save_initial_weights, 1, recipe, full, str(root))[0])


def stored_tensors(ckpt_dir: Path) -> Dict[str, "torch.Tensor"]:
    """Every tensor a torch_dist checkpoint stores (model and optimizer), whole, by key, as stored.

    Read straight from the files (torch DCP, no process group, no model): two checkpoints compare
    bit for bit whatever layout wrote them.
    """
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(ckpt_dir), str(target))
        loaded = torch.load(target, map_location="cpu", weights_only=False)
    out: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", loaded)
    return out


def differing_tensors(a: Dict[str, "torch.Tensor"], b: Dict[str, "torch.Tensor"], prefix: str = "") -> List[str]:
    """Keys (under ``prefix``) whose tensors are not bit-identical, or that only one side has."""
    import torch

    keys = sorted(k for k in set(a) | set(b) if k.startswith(prefix))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
