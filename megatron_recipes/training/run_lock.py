"""One run per ``run.dir`` at a time: an exclusive lock file, taken by global rank 0 before anything is read
or written there.

Why: two runs sharing a run directory interleave their checkpoints and logs; one can adopt the other's
half-written checkpoint, truncate its ``log.jsonl`` and replace its ``config.yaml``. The lock file
(``run.lock``) is created with ``O_EXCL`` (atomic on local and network filesystems) and names its holder:
host, pid, Slurm job id, start time. A lock left behind by a crash is stale, and taken over, when
- it holds this job's own Slurm job id (a requeued job of the same run: its earlier instance is gone), or
- its holder ran on this host and that process no longer exists.
A holder on another host cannot be checked from here, so that case is refused with the holder named and
the way out (delete the file once you know that run is gone). The file is removed when the run ends.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError

LOCK_NAME = "run.lock"


def _me() -> Dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_holder(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or foreign content: a holder we cannot describe


def _stale_because(holder: Dict[str, Any], me: Dict[str, Any]) -> Optional[str]:
    if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
        return f"Slurm job {holder['slurm_job_id']} was requeued"
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
        return f"process {holder['pid']} on {holder['host']} no longer exists"
    return None


def describe(holder: Dict[str, Any]) -> str:
    if not holder:
        return "an unknown holder (the lock file is unreadable)"
    job = holder.get("slurm_job_id")
    return (f"host {holder.get('host')}, pid {holder.get('pid')}" + (f", Slurm job {job}" if job else ", no Slurm job")
            + f", started {holder.get('started')}")


class RunLock:
    """The lock on one run directory (held by this process from ``acquire`` to ``release``)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir).expanduser().resolve() / LOCK_NAME
        self.mine: Optional[Dict[str, Any]] = None
        self.took_over: Optional[str] = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = _me()
        for _ in range(3):  # a holder may vanish between our attempts
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:
                    continue
                reason = _stale_because(holder, me)
                if reason is None:
                    raise RecipeError(
                        f"run.dir '{self.path.parent}' is in use by another run ({describe(holder)}); two runs in "
                        "one run directory would overwrite each other's checkpoints, config.yaml and log.jsonl",
                        fix=f"wait for it to finish or use another run.dir; if that run is gone (its node crashed), "
                        f"delete {self.path}",
                    )
                self._write(me)  # take over: replace the stale holder's record with ours
                self.took_over = f"took over a stale lock ({describe(holder)}): {reason}"
                self.mine = me
                return self
            with os.fdopen(fd, "w") as handle:
                json.dump(me, handle)
            self.mine = me
            return self
        raise RecipeError(f"could not take the lock {self.path}", fix="check that the run directory is writable")

    def _write(self, me: Dict[str, Any]) -> None:
        files.write_text(self.path, json.dumps(me))

    def release(self) -> None:
        """Remove the lock file if it is still ours (a takeover by a requeued instance leaves theirs)."""
        if self.mine is None:
            return
        holder = read_holder(self.path)
        if holder and holder.get("host") == self.mine["host"] and holder.get("pid") == self.mine["pid"]:
            self.path.unlink(missing_ok=True)
        self.mine = None
