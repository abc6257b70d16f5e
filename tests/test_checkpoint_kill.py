"""A training process SIGKILLed while it writes a checkpoint: the previous complete one is found and loads.

The child is a plain script with no ``if __name__ == "__main__":`` guard, run as ``python script.py``:
with megatron-core 0.16's stock writer its first save would re-run the script in a spawned Manager
process and never return (see megatron_recipes/checkpoint/_mcore.py). It saves step 1, prints a weight checksum,
trains on and is killed (with its writer processes) once step 2's staging folder has data in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
BIG = cs.BIG  # the kill follows the first file of its ~150 MB save within ms

CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch
import checkpoint_support as cs
from megatron_recipes.checkpoint import BackgroundSaves, checkpoints_root, save

t = cs.Trainer(cs.tiny_cfg({run_dir!r}, extra={big!r}))
root = checkpoints_root(t.cfg)
t.train(1, 1)
save(root, 1, t.model, t.optimizer, t.scheduler, {{"step": 1}}, t.cfg, keep_last=2)
print("CHECKSUM", repr(cs.checksum(t.model)), flush=True)
print("SAVED 1", flush=True)
t.train(2, 2)
background = BackgroundSaves() if {asynchronous!r} else None  # checkpoint.async_save: a forked writer
save(root, 2, t.model, t.optimizer, t.scheduler, {{"step": 2}}, t.cfg, keep_last=2, background=background)
if background is not None:
    background.wait("in the test")
print("SAVED 2", flush=True)
"""


def _wait_for(predicate, timeout: float, poll: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def _resume(run_dir: str):
    from megatron_recipes import checkpoint as ck
    from megatron_recipes.checkpoint._start import resolve_load

    t = cs.Trainer(cs.tiny_cfg(run_dir, extra=BIG), seed=3)
    path = resolve_load(t.cfg)
    state = ck.load(path, t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    out = {"path": path.name, "state": state, "checksum": cs.checksum(t.model)}
    root = ck.checkpoints_root(t.cfg)
    out["saved"] = ck.save(root, 2, t.model, t.optimizer, t.scheduler, {"step": 2}, t.cfg, 2).name
    out["latest"] = ck.latest(root).name
    return out


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, asynchronous):
    """``async``: the kill lands while the forked background writer writes (it dies with the rank's group)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    script = tmp_path / "train_unguarded.py"
    script.write_text(textwrap.dedent(CHILD.format(tests=str(TESTS), run_dir=str(run_dir), big=BIG, asynchronous=asynchronous)))
    log = tmp_path / "child.log"
    staging = root / "iter_0000002.incomplete"
    with open(log, "w") as out:
        # -X faulthandler: a child that dies natively says where (its log would otherwise just stop)
        child = subprocess.Popen([sys.executable, "-X", "faulthandler", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        saved_1 = _wait_for(lambda: "SAVED 1" in log.read_text() or child.poll() is not None, timeout=600, poll=0.2)
        assert saved_1 and "SAVED 1" in log.read_text(), (
            f"the child did not save step 1 (exit code {child.poll()}):\n{log.read_text()[-3000:]}")
        writing = _wait_for(lambda: staging.is_dir() and any(staging.iterdir()), timeout=300)
        os.killpg(child.pid, signal.SIGKILL)  # the rank and its forked writer processes
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    text = log.read_text()
    assert writing, f"step 2's save never started:\n{text[-3000:]}"
    assert "SAVED 2" not in text and not (root / "iter_0000002").exists(), "the kill came too late to test anything"
    assert staging.is_dir() and not (staging / "meta.json").exists()  # a torn save was left behind ...
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

    from megatron_recipes.checkpoint import latest

    assert latest(root) == root / "iter_0000001"  # ... and ignored
    checksum = float(text.split("CHECKSUM", 1)[1].split()[0])

    (resumed,) = run_ranks(_resume, 1, str(run_dir))
    assert resumed["path"] == "iter_0000001" and resumed["state"]["step"] == 1
    assert resumed["checksum"] == checksum
    assert resumed["saved"] == resumed["latest"] == "iter_0000002"
    assert not staging.exists()  # the next save cleared the torn one
