"""Ctrl-C stops a training job at once with one line, not a KeyboardInterrupt traceback from every rank
(issue 30, case 14), and says where the next start resumes."""

from __future__ import annotations

import os
import signal
import time

import pytest

import train_support as ts

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path, cache):
    proc = ts.start(tmp_path / "run", cache, *ts.FAST, "train.train_iters=100000", "checkpoint.save_interval=2", nproc=2)
    lines, deadline = [], time.time() + 300
    while time.time() < deadline:  # until a checkpoint exists and training goes on after it
        line = proc.stdout.readline()
        lines.append(line)
        if "step      3/" in line or proc.poll() is not None:
            break
    assert proc.poll() is None, "".join(lines)[-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(said) == 1 and "iter_0000002" in said[0], output[-3000:]
