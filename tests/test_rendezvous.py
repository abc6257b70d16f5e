"""Local ranks meet on a store their launcher already holds (runtime/distributed.hosted_store), so no other
process can take the rendezvous port between the launcher choosing it and rank 0 binding it. CI failed that
way once: a port picked free and released was in use by the time rank 0 bound it (EADDRINUSE), with two test
workers starting runs side by side."""

from __future__ import annotations

import errno
import os
import socket
import textwrap
import time

from megatron_recipes.runtime import ranks

RANK = textwrap.dedent("""
    import os, pathlib, sys, time
    import torch, torch.distributed as dist

    out, rank = pathlib.Path(sys.argv[1]), int(os.environ["RANK"])
    (out / f"rank{rank}.port").write_text(os.environ["MASTER_PORT"])
    while not (out / "go").exists():  # the test tries to take the port meanwhile
        time.sleep(0.02)
    dist.init_process_group("gloo")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    (out / f"rank{rank}.sum").write_text(str(int(total.item())))
    dist.destroy_process_group()
""")


def test_another_process_cannot_take_the_port_the_ranks_were_told(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ranks.LAUNCHER_VARS}
    job = ranks.start((str(script),), (str(tmp_path),), env, str(tmp_path / "log"), 2)
    intruder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank0.port").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        port = int((tmp_path / "rank0.port").read_text())
        try:  # as any process on the machine might, before rank 0 starts its group
            intruder.bind(("127.0.0.1", port))
            intruder.listen()
            taken = True
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            taken = False
        (tmp_path / "go").write_text("")
        code = job.wait(timeout=120)
    finally:
        intruder.close()
        if job.poll() is None:
            job.kill()
    log = (tmp_path / "log").read_text()
    assert not taken, f"port {port} was free for anyone to take before the ranks met on it"
    assert code == 0, log[-3000:]
    assert [(tmp_path / f"rank{r}.sum").read_text() for r in range(2)] == ["3", "3"], log[-3000:]
