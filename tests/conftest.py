"""Session-wide fixtures: what several test modules would otherwise build again from the same inputs.

Why: CI time on a 2-core machine. Two things are computed once per session instead of once per module:
- ``data_cache``: one ``data.cache_dir`` for every trainer run. Its artefacts (built-in corpus, tokenizer,
  indexed datasets, megatron-core's index caches) are content-keyed (``data/artifact_cache.py``), so runs
  with other data settings get their own entries and runs with the same settings reuse one build.
- ``shared_runs``: results that are fully determined by their inputs (a step-0 checkpoint and the
  single-rank reference losses of one recipe + overrides), keyed by those inputs. Two modules asking for
  the same key get the same result, computed by whichever asks first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Hashable

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def cache(data_cache) -> Path:
    """The name the trainer tests use: one data cache per session (inputs key its contents)."""
    return data_cache


class SharedRuns:
    """A memo of deterministic results, keyed by everything that determines them."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._factory = tmp_path_factory
        self._done: Dict[Hashable, Any] = {}

    def folder(self, name: str) -> Path:
        """A new folder for one shared result (numbered: two results never share one)."""
        return self._factory.mktemp(name)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self._done:  # a failed ``make`` stores nothing: the next test that needs it retries
            self._done[key] = make()
        return self._done[key]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory)
