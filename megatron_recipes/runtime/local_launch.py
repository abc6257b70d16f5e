"""The local launcher of ``train``, ``generate``, ``eval`` and ``serve``: one machine's ranks started by the
command itself, with torchrun's ``--standalone`` contract (each rank its own process with RANK, WORLD_SIZE,
LOCAL_RANK and a rendezvous; the first rank that fails stops the others; a signal to the command reaches
every rank; the job's exit code is the failing rank's) and the failing rank's message said once
(runtime/rank_errors.py).

Two ways to start them. Without CUDA (the CPU lane) the ranks fork from one server that imported torch,
megatron-core and the trainer once (runtime/ranks.py, as ``check`` starts its runs): a rank started as a
fresh interpreter paid ~3-4 s of CPU importing them again, more than a tiny run trains. With CUDA, torchrun
starts fresh interpreters: a server that imported Transformer Engine may have initialised CUDA, and a
process forked after that cannot use the GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Dict, Sequence

STOPPING_GRACE_S = 30.0  # a signalled rank's time to stop before SIGKILL, as torchrun's agent gives it
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what torchrun's agent passes on


def spawn_local(argv: Sequence[str], nproc: int, target: Sequence[str] = ("--module", "megatron_recipes.train"),
                tokenizers: bool = False, compiles: bool = False) -> int:
    """Run ``nproc`` ranks of ``target`` (a module or a script) with ``argv``; their exit code. ``tokenizers``:
    the ranks load a Hugging Face tokenizer; ``compiles``: they build an MoE model (forked ranks then find
    transformers' loading, or torch.compile's machinery, imported)."""
    import torch

    if torch.cuda.is_available():
        return torchrun_ranks(argv, nproc, target)
    return forked_ranks(argv, nproc, target, tokenizers, compiles)


def _share_the_cores(nproc: int) -> None:
    if "OMP_NUM_THREADS" not in os.environ:  # one share of the cores per rank (torchrun would pick 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def _said(folder, codes: Dict[int, int]) -> None:
    """The ranks' own message, or which ranks failed with which code: ranks that ended together (one died, its
    peer's collective then failed) are all named, the order they failed in is not known."""
    from megatron_recipes.runtime import rank_errors

    told = rank_errors.summary(folder)
    failed = "; ".join(f"rank {rank} failed (exit code {code})" for rank, code in sorted(codes.items()))
    print(told or f"error: {failed}; the other ranks were stopped", file=sys.stderr)


def torchrun_ranks(argv: Sequence[str], nproc: int, target: Sequence[str]) -> int:
    """The ranks as fresh interpreters, through torchrun's own launcher (``--standalone``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megatron_recipes.runtime import rank_errors

    _share_the_cores(nproc)
    launcher_args = ["--standalone", f"--nproc_per_node={nproc}", "--max_restarts=0", *target]
    # torch elastic logs each failed rank at ERROR ("failed (exitcode: 2) local_rank: 1 ..."); the one line
    # said here names it, with the rank's own message
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with rank_errors.collected() as folder:
        try:
            run(parse_args(launcher_args + list(argv)))
        except ChildFailedError as exc:
            codes = sorted({f.exitcode for f in exc.failures.values()}, key=lambda c: (c < 0, c))
            failed = {f.local_rank: f.exitcode for f in exc.failures.values()}
            # torchrun stops the other ranks with SIGTERM and counts them as failed too: name the rank(s) that were not
            # stopped that way (all of them when each ended by SIGTERM, e.g. a preemption reaching every rank)
            _said(folder, {r: c for r, c in failed.items() if c != -signal.SIGTERM} or failed)
            return codes[0] if 0 < codes[0] < 128 else 1
        except SignalException as exc:
            print(f"stopped by signal {exc.sigval.name}; the ranks were stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


def forked_ranks(argv: Sequence[str], nproc: int, target: Sequence[str], tokenizers: bool = False,
                 compiles: bool = False) -> int:
    """The ranks forked from the preloaded server, their output this command's own."""
    from megatron_recipes.runtime import rank_errors, ranks

    _share_the_cores(nproc)
    entry = ("-m", target[1]) if target[0] in ("--module", "-m") else tuple(target)
    caught = []

    def pass_on(signum, _frame) -> None:  # each rank gets it once, as from torchrun's agent
        if not caught:
            job.signal(signum)
        caught.append(signum)

    sys.stdout.flush()
    sys.stderr.flush()
    with rank_errors.collected() as folder:
        job = ranks.start(entry, argv, dict(os.environ), None, nproc, tokenizers=tokenizers, compiles=compiles)
        previous = {sig: signal.signal(sig, pass_on) for sig in SIGNALS}
        try:
            stop_by = None
            while True:
                try:
                    code = job.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if caught and stop_by is None:
                    stop_by = time.monotonic() + STOPPING_GRACE_S
                if stop_by is not None and time.monotonic() > stop_by:
                    job.kill()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if job.poll() is None:
                job.kill()
            ranks.stop()  # the server holds this command's output open: ended with the ranks
        if caught:
            name = signal.Signals(caught[0]).name
            print(f"stopped by signal {name}; the ranks were stopped", file=sys.stderr)
            return 128 + int(caught[0])
        if code != 0:
            _said(folder, {rank: job.procs[rank].exitcode for rank in job.failed_ranks})
    return code
