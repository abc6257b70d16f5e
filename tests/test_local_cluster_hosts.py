"""slurm/local_cluster.sh takes its fake nodes' names out of the hosts file without ever emptying it: the Slurm tests
start and stop that cluster while other tests' ranks run, and gloo resolves this machine's name for every process
group a rank makes (one rank failed with "device.cc:99 rv == 0. -2 vs 0" when it read the file mid-rewrite)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "local_cluster.sh"
TAG = "# megatron-recipes local cluster"


def test_the_names_are_removed_in_place_and_the_machines_own_line_is_never_missing(tmp_path):
    hosts = tmp_path / "hosts"
    own = "127.0.0.1 localhost\n127.0.0.1 thismachine\n"
    hosts.write_text(own)
    inode = hosts.stat().st_ino
    env = dict(os.environ, SLURM_LOCAL_HOSTS=str(hosts), SLURM_LOCAL_DIR=str(tmp_path / "state"))
    seen_without, stop = [], threading.Event()

    def read_all_the_time() -> None:
        while not stop.is_set():
            if "thismachine" not in hosts.read_text():
                seen_without.append(1)

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        for _ in range(100):  # as each cluster start and stop of a test session does
            with hosts.open("a") as f:
                f.write(f"127.0.0.1 n1 n2{TAG}\n")
            subprocess.run(["bash", str(SCRIPT), "unlist-hosts"], env=env, check=True, timeout=30)
    finally:
        stop.set()
        reader.join()
    assert hosts.read_text() == own and hosts.stat().st_ino == inode  # in place: the file may be a bind mount
    assert not seen_without, f"the machine's own line was missing in {len(seen_without)} reads"
