"""Session-wide fixtures: what several test modules would otherwise build again from the same inputs.

Why: CI time on a 2-core machine. Two things are computed once per session instead of once per module:
- ``data_cache``: one ``data.cache_dir`` for every trainer run. Its artefacts (built-in corpus, tokenizer,
  indexed datasets, megatron-core's index caches) are content-keyed (``data/artifact_cache.py``), so runs
  with other data settings get their own entries and runs with the same settings reuse one build.
- ``shared_runs``: results that are fully determined by their inputs (a step-0 checkpoint and the
  single-rank reference losses of one recipe + overrides), keyed by those inputs. Two modules asking for
  the same key get the same result, computed by whichever asks first.

Under pytest-xdist (CI runs ``-n``) "the session" is every worker of one run: both live in a folder the
workers share (the parent of each worker's base temp), the data cache under the library's own build lock
and each shared result under a file lock of its own, so a result is computed once per run, not per worker.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, Hashable

import pytest


def _run_root(factory: pytest.TempPathFactory) -> Path:
    """The folder every process of this run shares: the base temp, or its parent under xdist's workers."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    folder = _run_root(tmp_path_factory) / "data-cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def cache(data_cache) -> Path:
    """The name the trainer tests use: one data cache per session (inputs key its contents)."""
    return data_cache


class SharedRuns:
    """A memo of deterministic results, keyed by everything that determines them, shared by the run's workers.

    A result is pickled beside a lock of its own: the first process to ask computes it while the others
    wait on the lock, then read it. A failed ``make`` stores nothing: the next test that needs it retries.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._root = _run_root(tmp_path_factory) / "runs"
        self._root.mkdir(exist_ok=True)
        self._done: Dict[Hashable, Any] = {}

    def folder(self, name: str) -> Path:
        """A new folder for one shared result (numbered: two results never share one, across workers too)."""
        import tempfile

        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._root))

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self._done:
            return self._done[key]
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        stored = self._root / f"{name}.pkl"
        with open(self._root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes, also if ``make`` raises
            if stored.exists():
                value = pickle.loads(stored.read_bytes())
            else:
                value = make()
                partial = stored.with_suffix(".partial")
                partial.write_bytes(pickle.dumps(value))
                partial.replace(stored)
        self._done[key] = value
        return value


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory)


RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture(autouse=True)
def _rendezvous_stays_in_its_test():
    """Each test ends with the launcher variables it started with. A test that opens a process group in this
    process (a one-rank group, a command's ``main()``) leaves MASTER_PORT in ``os.environ`` while its store
    still listens there: a later test's subprocess inherited it and failed with EADDRINUSE (which test ran
    before which depends on the run's order and its workers)."""
    saved = {name: os.environ.get(name) for name in RENDEZVOUS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist would hand out the files by their number of tests, most first, which put the Slurm file
        # (3 tests, the longest) near the end: keep the order pytest_collection_modifyitems gives
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the workers share the machine's cores: a reference forward in one worker must not take both
        import torch

        torch.set_num_threads(1)


# The longest files, longest first (per-file totals of `pytest --durations`, leg 1): under ``-n --dist loadfile``
# a long file picked up last keeps one worker busy while the other has nothing left to run (leg 1 ended at
# 70-80% CPU when the Slurm file came last). The LoRA runs test_eval builds are shared by test_serve and
# test_eval_harness: those come a few files later, not beside it, so that no worker waits on the other's build.
# A stale order costs minutes, never a result.
LONGEST = ("test_slurm_cluster.py", "test_eval.py", "test_check_cli.py", "test_generate.py", "test_ep_overlap.py",
           "test_peft_train.py", "test_convert_families.py", "test_serve.py", "test_eval_harness.py",
           "test_train_resume.py", "test_train_cli.py", "test_recompute.py", "test_parallel_equivalence.py",
           "test_peft_expert_export.py", "test_fuzz_recipes.py", "test_estimates_activations.py",
           "test_context_parallel_training.py", "test_rules.py", "test_check_units.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The longest files first (LONGEST), then files with the longest kinds of tests (the Slurm cluster, then
    multi-process ones), each file's tests in their own order."""

    def weight(item) -> int:
        if item.path.name in LONGEST:
            return LONGEST.index(item.path.name)
        marks = {m.name for m in item.iter_markers()}
        return len(LONGEST) + (0 if "slurm" in marks else 1 if "slow" in marks else 2)

    heaviest: Dict[str, int] = {}
    for item in items:
        path = str(item.path)
        heaviest[path] = min(heaviest.get(path, len(LONGEST) + 2), weight(item))
    order = {path: i for i, path in enumerate(dict.fromkeys(str(item.path) for item in items))}
    items.sort(key=lambda item: (heaviest[str(item.path)], order[str(item.path)]))
