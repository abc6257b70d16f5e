"""What a run records about where it ran (versions, host, Slurm job), for the report's restart and versions tables."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from typing import Any, Dict

PACKAGES = ("megatron-recipes", "megatron-core", "torch", "transformer-engine", "transformers", "tokenizers",
            "numpy", "hydra-core", "omegaconf")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Dict[str, str]:
    """The run log's software stack (megatron-core, TE, torch, CUDA) plus what else shapes a result."""
    from megatron_recipes.runtime.versions import stack

    out = {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}, **stack()}
    out["platform"] = platform.platform()
    return out


def run_facts() -> Dict[str, Any]:
    """Facts of this start of a run (one per start, so restarts are visible): host, Slurm job, versions."""
    return {
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "versions": versions(),
    }
