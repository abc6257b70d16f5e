"""``megatron-recipes serve <run dir | checkpoint> [host=127.0.0.1] [port=8000] [key=value ...]``.

An OpenAI-compatible endpoint on the checkpoint: /v1/completions, /v1/chat/completions (the run's chat
template), /v1/models, streaming included, through megatron-core's inference engine (as ``generate``).

options  host=127.0.0.1 (localhost unless told otherwise)  port=8000 (0: any free port, printed)
         max_batch=8 (requests generated together)  max_tokens=64 (when a request gives none)
         name=<model id> (default: the run's name)  tokenizer=<HF tokenizer folder>  dtype=bf16|fp32
         parallel.tp= parallel.pp= parallel.ep= parallel.etp=  (default: the checkpoint's layout if it fits here)
flags    --trust-checkpoint (see SECURITY.md)
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

from megatron_recipes import checkpoint
from megatron_recipes.cli_args import options, split_args
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.generate.options import Dtype, Layout

PROG = "megatron-recipes serve"
FLAGS = {"trust-checkpoint": False}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = field(default=8000, metadata={"min": 0})
    max_batch: int = field(default=8, metadata={"min": 1})
    max_tokens: int = field(default=64, metadata={"min": 1})
    name: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Optional[Dtype] = None
    parallel: Layout = field(default_factory=Layout)


def _require_server_packages() -> None:
    try:
        import fastapi  # noqa: F401  (imported here: a missing package is one line, before any rank starts)
        import uvicorn  # noqa: F401
    except ImportError:
        raise RecipeError("serve needs FastAPI and uvicorn", fix='pip install "megatron-recipes[serve]"') from None


def _listen(host: str, port: int) -> socket.socket:
    """The socket, bound now: a taken port is one error line, and port=0's choice can be printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RecipeError(f"{PROG}: cannot listen on {host}:{port} ({exc.strerror or exc})",
                          fix="choose another port=, or port=0 for any free one") from None
    sock.listen(128)
    return sock


def main(argv: List[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help") or "--help" in argv:
        print(__doc__.strip())
        return 0
    args = split_args(argv, PROG, flags=FLAGS, positional=("checkpoint",))
    opts = options(args.overrides, PROG, ServeOptions)
    _require_server_packages()
    os.environ.setdefault("TQDM_DISABLE", "1")
    from megatron_recipes.runtime import patches

    patches.apply("process")
    from megatron_recipes.config.derived import is_moe
    from megatron_recipes.convert import layout as layouts
    from megatron_recipes.data.prompts import PromptMaker, run_tokenizer
    from megatron_recipes.data.tokenizer import check_fits_model
    from megatron_recipes.generate.cli import default_dtype, layout_for
    from megatron_recipes.runtime.local_launch import spawn_local
    from megatron_recipes.training.cli import quiet_known_warnings, under_launcher

    quiet_known_warnings()
    if args.flags.get("trust-checkpoint"):
        os.environ[checkpoint.TRUST_ENV] = "1"
    resolved, cfg, meta = checkpoint.read_run(checkpoint.resolve(Path(args.positional[0])))
    layout = layout_for(meta.get("layout") or {}, opts.parallel.given())
    tokenizer = run_tokenizer(cfg, resolved, meta, opts.tokenizer)
    check_fits_model(tokenizer, cfg)
    world = layouts.min_world_size(layout)
    if not under_launcher() and world > 1:
        _listen(opts.host, opts.port).close()  # a taken port is refused before the ranks start
        sys.stdout.flush()
        return spawn_local(argv, world, target=("--module", "megatron_recipes.serve"), tokenizers=True,
                           compiles=is_moe(cfg.model))

    @lru_cache(maxsize=None)
    def makers(kind: str, stops: tuple):
        return PromptMaker(tokenizer, cfg, chat=kind == "chat").add_stops(stops)

    dtype = opts.dtype.value if opts.dtype is not None else default_dtype(cfg)
    return _serve(opts, cfg, resolved, layout, dtype, makers)


def _serve(opts: ServeOptions, cfg, resolved: Path, layout, dtype: str, makers) -> int:
    import torch

    from megatron_recipes.convert import layout as layouts
    from megatron_recipes.generate.engine import model_for
    from megatron_recipes.runtime.distributed import shutdown
    from megatron_recipes.serve.batcher import Batcher

    sock = None
    try:
        leader = int(os.environ.get("RANK", "0")) == 0
        sock = _listen(opts.host, opts.port) if leader else None
        loaded = model_for(str(resolved), layout, dtype)
        batcher = Batcher(str(resolved), layout, dtype, loaded, makers, opts.max_batch)
        if not leader:
            try:
                batcher.follow()
            except KeyboardInterrupt:
                pass
            return 0
        import uvicorn

        from megatron_recipes.serve.app import make_app

        name = opts.name or cfg.run.name
        encode = lambda kind, prompt: (makers(kind, ()).encode(prompt[-1]["content"], prompt[:-1]).ids if kind == "chat"
                                       else makers(kind, ()).encode(prompt).ids)
        app = make_app(name, batcher.submit, encode, cfg.model.max_position_embeddings, opts.max_tokens)
        # The engine runs on this (the main) thread, where the process set up torch and the CPU lane; the
        # HTTP server on a thread of its own. Ctrl-C reaches the main thread: it stops both.
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve-http", daemon=True)
        http.start()
        host, port = sock.getsockname()[:2]
        where = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
        print(f"serving {name} ({resolved}, {layouts.layout_string(layout)}, {dtype}) on {where}; Ctrl-C stops", flush=True)
        if opts.host not in LOOPBACK:
            print(f"note: bound to {opts.host}: anyone who can reach this machine can use the endpoint", flush=True)
        try:
            batcher.lead()
        except KeyboardInterrupt:  # Ctrl-C reaches every rank (torchrun forwards it): nobody waits for a batch
            pass
        finally:
            server.should_exit = True
            http.join(timeout=10)
        print(f"stopped after {batcher.batches} batch(es)", flush=True)
        return 0
    finally:
        if sock is not None:
            sock.close()
        if torch.distributed.is_initialized():
            shutdown()
