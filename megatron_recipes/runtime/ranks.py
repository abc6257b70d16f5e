"""Ranks forked from one server that imported the stack once: a check's runs, the local launcher's ranks on
the CPU lane (runtime/local_launch.py) and the tests' ranks.

Why: a tiny check is mostly interpreter start-up. Started as ``python -m megatron_recipes.train``, every
run paid ~4 s of CPU importing torch, megatron-core, Hydra and the trainer, and a multi-rank run paid it
once more per rank (``train``'s own process validating, then each torchrun rank). Here every rank of every
run is forked from one ``forkserver`` (training/rank_preload.py) started when the check starts, so the
imports overlap the check's own planning and are paid once. A rank still is its own process, starting from
the state a fresh interpreter reaches after those imports, with the environment a launcher gives it (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), its output in the run's log (or the caller's), in its own
process group (a stopped run takes every process its ranks started with it), and it runs the very
entry a user runs (``python -m megatron_recipes.train <recipe> [overrides]``): composition, the rule
table, the trainer, checkpoints over gloo.
"""

from __future__ import annotations

import atexit
import gc
import os
import random
import runpy
import signal
import subprocess
import sys
import time
from multiprocessing import connection
from typing import Dict, List, Optional, Sequence

from megatron_recipes.runtime.distributed import hosted_store

PRELOAD = ["megatron_recipes.training.rank_preload"]
# What a run with a Hugging Face tokenizer (fine-tuning data) loads it with: ~2 s of CPU per rank otherwise.
TOKENIZER_PRELOAD = ["transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers"]
# What the first call of a ``torch.compile``d function imports (Inductor; the deferred compile of
# runtime/patches/_process.py): megatron-core's MoE router calls one on every forward (``_apply_expert_bias``),
# ~0.7 s of CPU per MoE rank otherwise.
COMPILE_PRELOAD = ["torch._inductor.compile_fx"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE")


def context(tokenizers: bool = False, compiles: bool = False):
    """The forkserver context; its server starts here (preloading in the background) if not yet running,
    with transformers' tokenizer loading too when ``tokenizers`` (a module it lacks is skipped) and
    ``torch.compile``'s machinery when ``compiles`` (the ranks build an MoE model).

    One server per process (Python's forkserver is a per-process singleton): when another caller started
    it with its own preload, ranks still start correctly, they import what that preload lacked."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + (TOKENIZER_PRELOAD if tokenizers else []) + (COMPILE_PRELOAD if compiles else []))
    _ask_the_server_that_forked_this_process(forkserver._forkserver)
    forkserver._forkserver.ensure_running()  # the instance's: the module's name is bound to the class's method
    return ctx


def _ask_the_server_that_forked_this_process(server) -> None:
    """A process the server forked (a command run as one of its ranks) has its ranks forked by that same server.

    Such a process knows the server's address and holds a client's end of its alive pipe (Python's forkserver
    hands both to every child), but it is not the server's parent, so the stdlib would start a second server:
    a fresh interpreter importing torch and megatron-core again (~4 s of CPU). Its ranks are forked from the
    same preloaded state either way; their output and folder are the caller's (``start``)."""
    from multiprocessing import resource_tracker

    forked = server._forkserver_pid is None and server._forkserver_address is not None
    if forked and server._forkserver_alive_fd is not None and "ensure_running" not in vars(server):
        server.ensure_running = resource_tracker.ensure_running  # the server runs: only the tracker to check


def stop() -> None:
    """Stop this process's server now, when no rank of it runs any more. Ending with the check, it would
    first finish its preload (seconds), holding the check's output open meanwhile (a caller reading that
    output to its end, e.g. after an early recipe error, would wait for it)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the stdlib's one server per process; it has no public stop
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()


def fresh_signals() -> None:
    """The signal handling a rank that torchrun started has, whatever its launcher's own: SIGINT raises
    KeyboardInterrupt, SIGTERM, SIGHUP and SIGQUIT end the process. A forked rank would otherwise keep what the
    server inherited when it was started: a command run in the background (``cmd &`` in a script, CI) has
    SIGINT and SIGQUIT ignored, and its ranks then ignored the Ctrl-C the launcher passes on until it killed
    them, with no checkpoint said (torchrun's agent handles these signals itself: its ranks start with the
    defaults)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


class _CallerOutput:
    """The caller's stdout and stderr as file descriptors, handed to a forked rank through the server as
    Python hands a pipe (``multiprocessing.reduction.DupFd``): a rank without a log writes where its launcher
    writes now, not where the server's starter wrote when the server started (another command, in a process
    the server forked; a test whose output was captured then)."""

    def __init__(self, fds: Sequence[int]):
        self.fds = tuple(fds)

    def __reduce__(self):
        from multiprocessing import reduction

        return _caller_output, (tuple(reduction.DupFd(fd) for fd in self.fds),)


def _caller_output(dups) -> _CallerOutput:
    return _CallerOutput([dup.detach() for dup in dups])


def _open_fds(fds: Sequence[int]) -> bool:
    try:
        for fd in fds:
            os.fstat(fd)
    except OSError:
        return False
    return True


def _rank(entry: Sequence[str], argv: Sequence[str], env: Dict[str, str], log: Optional[str],
          cwd: Optional[str] = None, composed: Sequence = (), output: Optional[_CallerOutput] = None) -> None:
    """One rank, in the forked child: the run's environment, folder and output (``log``, else the caller's
    ``output``), the launcher's compositions (``composed``), then ``python <entry> <argv>``."""
    os.setpgid(0, 0)  # its own group: stopping the run stops whatever this rank starts (checkpoint writers)
    gc.freeze()  # what the server preloaded after rank_preload's own freeze (tokenizers, Inductor): out of collections
    fresh_signals()
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()  # the server's environment is that of its start: take the run's
    os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    elif output is not None:
        for target, fd in zip((1, 2), output.fds):
            os.dup2(fd, target)
            os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    random.seed()  # a fresh interpreter seeds these from OS entropy; forked ones would share the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():  # read at a fresh start only
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if composed:
        from megatron_recipes.config import compose

        compose.adopt(composed)
    try:
        if entry[0] == "-m":
            sys.argv = [entry[1], *argv]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [entry[0], *entry[1:], *argv]
            runpy.run_path(entry[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what a fresh interpreter runs at exit (the fork server's child would not)


def _kill_group(pid: int, running: bool) -> None:
    """SIGKILL to the process group a rank leads (it and what it started); to the rank alone when it is
    ``running`` but has no group yet (just forked). An ended rank's pid is never signalled by itself:
    once reaped, that number may belong to another process (a group's id is not reused while it lives)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        if running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    except PermissionError:  # the number is no longer one of ours
        pass


class Run:
    """The ranks of one run, waited on like one ``subprocess.Popen``: its exit code is the job's.

    As torchrun does, the first rank that fails stops the others (a rank would wait for a dead peer
    until the gloo timeout); the run's code is that rank's (a signal or a code above 127 becomes 1)."""

    def __init__(self, procs, args: Sequence[str], store=None):
        """``procs``: the ranks' processes, started; ``store``: their rendezvous, kept here while they run."""
        self.args = list(args)
        self.procs = list(procs)
        self.store = store
        self.returncode: Optional[int] = None
        self.failed_ranks: List[int] = []  # the ranks seen failing by themselves, before the others were stopped
        self._failed: Optional[int] = None

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        codes = [p.exitcode for p in self.procs]
        if self._failed is None:
            self.failed_ranks = [r for r, c in enumerate(codes) if c not in (None, 0)]  # ended together: order unknown
            self._failed = codes[self.failed_ranks[0]] if self.failed_ranks else None
            if self._failed is not None and None in codes:
                self.kill()
                codes = [p.exitcode for p in self.procs]
        if None in codes:
            return None
        code = self._failed or 0
        self.returncode = code if 0 <= code < 128 else 1
        self.store = None  # every rank ended: the port is given back
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            connection.wait([p.sentinel for p in self.procs if p.exitcode is None], left)
        return self.returncode

    def signal(self, signum: int) -> None:
        """``signum`` to every running rank's process group (each rank with what it started)."""
        for proc in self.procs:
            if proc.exitcode is None:
                try:
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):  # ended, or just forked and not yet its group's leader
                    try:
                        os.kill(proc.pid, signum)
                    except ProcessLookupError:
                        pass

    def kill(self) -> None:
        """SIGKILL to every rank's process group (each rank with what it started); waits for the ranks."""
        for proc in self.procs:
            _kill_group(proc.pid, running=proc.exitcode is None)
        for proc in self.procs:
            proc.join()
            _kill_group(proc.pid, running=False)  # a child the rank started just before it died


def rank_environments(env: Dict[str, str], ranks: int):
    """Each rank's environment (``env`` with the launcher's variables of this run) and the rendezvous store they
    meet on, hosted by the caller as torchrun's agent hosts it (None for one rank)."""
    base = {k: v for k, v in env.items() if k not in LAUNCHER_VARS}
    if ranks == 1:
        return [base], None
    store, rendezvous = hosted_store(ranks)
    base.update(rendezvous, WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    return [dict(base, RANK=str(rank), LOCAL_RANK=str(rank)) for rank in range(ranks)], store


def start(entry: Sequence[str], argv: Sequence[str], env: Dict[str, str], log: Optional[str], ranks: int,
          cwd: Optional[str] = None, tokenizers: bool = False, compiles: bool = False,
          output: Sequence[int] = (1, 2)) -> Run:
    """The ranks of one run, forked from the server (``log``: their output's file, None for the caller's own,
    ``output``: its stdout and stderr descriptors; ``cwd``: the folder they run in, default the server's;
    ``tokenizers``, ``compiles``: as for ``context``). The recipes this process composed go with them: a
    launcher that composed and validated the run's recipe spares each rank composing it again (~85 ms of CPU
    each)."""
    ctx = context(tokenizers, compiles)
    envs, store = rank_environments(env, ranks)
    compose = sys.modules.get("megatron_recipes.config.compose")
    composed = compose.compositions() if compose is not None else []
    caller = _CallerOutput(output) if log is None and _open_fds(output) else None
    procs = []
    for rank, rank_env in enumerate(envs):
        proc = ctx.Process(target=_rank, args=(tuple(entry), tuple(argv), rank_env, log, cwd, composed, caller),
                           name=f"rank{rank}")
        proc.start()
        procs.append(proc)
    return Run(procs, [sys.executable, *entry, *argv], store)
