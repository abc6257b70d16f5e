"""Checkpoints written without Transformer Engine load into modules that carry ``_extra_state``.

TE modules keep FP8 scaling history as ``_extra_state``; the CPU lane and ``convert import`` write none.
Here torch's RMSNorm is given a TE-like ``get_extra_state``/``set_extra_state`` in the loading process,
which is exactly what a TE model on a GPU asks a CPU-written checkpoint for.
"""

from __future__ import annotations

from pathlib import Path

from checkpoint_support import tiny_cfg
from multiproc import run_ranks


def _with_extra_state(received: list) -> None:
    import torch

    torch.nn.RMSNorm.get_extra_state = lambda self: {"fp8_history": torch.arange(3)}
    torch.nn.RMSNorm.set_extra_state = lambda self, state: received.append(state)


def _rank(root: str):
    import torch

    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime.distributed import init_model_parallel
    from megatron_recipes import checkpoint
    from megatron_recipes.checkpoint import _mcore as checkpoint_io

    cfg = tiny_cfg(str(Path(root) / "run"))
    init_model_parallel(cfg)
    plain = build_model_chunks(cfg)
    saved = checkpoint.save(Path(root) / "plain", 0, plain, None, None, {}, cfg, keep_last=0)

    received: list = []
    _with_extra_state(received)
    with_state = build_model_chunks(cfg)
    sharded = checkpoint_io.model_state(with_state, checkpoint_io.sharded_metadata(None))
    try:  # megatron-core alone refuses: the checkpoint lacks every _extra_state object
        checkpoint_io.load(sharded, saved)
        plain_load_error = ""
    except BaseException as exc:  # torch DCP raises CheckpointException, a BaseException
        plain_load_error = type(exc).__name__
    checkpoint.load_weights(saved, with_state, cfg)
    weights_equal = all(
        torch.equal(a, b) for a, b in zip(plain[0].state_dict().values(), with_state[0].state_dict().values())
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    )
    from_plain = list(received)

    received.clear()  # a checkpoint that does hold extra state gives it back unchanged
    again = checkpoint.save(Path(root) / "with_state", 0, with_state, None, None, {}, cfg, keep_last=0)
    checkpoint.load_weights(again, build_model_chunks(cfg), cfg)
    return {
        "plain_load_error": plain_load_error,
        "weights_equal": weights_equal,
        "states_from_plain": [s is None for s in from_plain],
        "states_from_saved": [isinstance(s, dict) and s["fp8_history"].tolist() == [0, 1, 2] for s in received],
    }


def test_cpu_written_checkpoint_loads_into_modules_with_extra_state(tmp_path):
    out = run_ranks(_rank, 1, str(tmp_path))[0]
    assert out["plain_load_error"], "megatron-core was expected to refuse the missing _extra_state objects"
    assert out["weights_equal"]
    assert out["states_from_plain"] and all(out["states_from_plain"])
    assert out["states_from_saved"] and all(out["states_from_saved"])
