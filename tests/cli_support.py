"""``megatron-recipes <args>`` run by tests as its own process, forked from the session's preloaded server.

Why: a command started as a fresh interpreter paid ~3 s of CPU importing torch and megatron-core, and another
~4 s starting a server of its own for its ranks, in each of the ~60 command runs of a test session. Forked
from the server the tests' ranks come from (runtime/ranks.py), the command is still its own process: its own
process group, environment, folder, stdout, stderr and exit code, the module ``python -m megatron_recipes.cli``
runs, started from the state a fresh interpreter reaches after those imports; its ranks fork from the same
server. What a fresh interpreter alone shows stays with ``subprocess``: start-up imports and patches
(test_cli_startup.py, test_patches.py), signals (test_train_interrupt.py), faults injected through
``PYTHONPATH`` (test_check_cli.py), the console script (test_train_cli.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Dict, Optional, Sequence

def run_cli(args: Sequence[str], *, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
            timeout: float = 600.0) -> subprocess.CompletedProcess:
    """The command's exit code, stdout and stderr, as ``subprocess.run(..., capture_output=True, text=True)``
    gives them (``env``: the whole environment, default this process's; ``cwd``: default this one's)."""
    return run_module("megatron_recipes.cli", args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, args: Sequence[str], *, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
               timeout: float = 600.0) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` so (``python -m megatron_recipes.train`` is the trainer's own launcher)."""
    from megatron_recipes.runtime import ranks

    full_env = dict(os.environ if env is None else env)  # less a launcher's variables: one rank gets none
    command = [sys.executable, "-m", module, *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        job = ranks.start(("-m", module), list(args), full_env, None, 1, cwd=str(cwd or os.getcwd()),
                          tokenizers=True, compiles=True, output=(out.fileno(), err.fileno()))
        try:
            code = job.wait(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            raise
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="backslashreplace")
        stderr = err.read().decode(errors="backslashreplace")
    return subprocess.CompletedProcess(command, code, stdout, stderr)
