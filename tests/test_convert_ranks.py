"""The ranks conversion's checks run on (convert/ranks.py): each its own process in one process group, the
caller's environment, a rank's RecipeError said as the user's error, and a failing rank stopping the rest
instead of leaving them waiting in a collective."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.convert import ranks as convert_ranks
from megatron_recipes.convert.ranks import run_ranks
from megatron_recipes.runtime import ranks


def _sum_ranks(out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_recipes.runtime.distributed import init_process_group, shutdown

    init_process_group()
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    Path(out, f"rank{dist.get_rank()}.txt").write_text(f"{int(total.item())} {os.getpid()} "
                                                       f"{os.environ.get('CONVERT_RANKS_PROBE')}")
    shutdown()


def _one_rank_fails(how: str) -> None:
    import torch.distributed as dist

    from megatron_recipes.runtime.distributed import init_process_group

    init_process_group()
    if dist.get_rank() == 1:
        if how == "recipe":
            raise RecipeError("layout tp=3 does not divide 4 heads", fix="pick tp=2")
        os._exit(3)
    dist.barrier()  # waits for rank 1, which never comes


def test_every_rank_runs_in_its_own_process_with_the_callers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVERT_RANKS_PROBE", "seen")
    run_ranks(_sum_ranks, 3, str(tmp_path))
    rows = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(3)]
    assert [r[0] for r in rows] == ["6"] * 3
    assert len({r[1] for r in rows} | {str(os.getpid())}) == 4
    assert [r[2] for r in rows] == ["seen"] * 3


@pytest.mark.parametrize("how", ["recipe", "dies"])
def test_a_failing_rank_stops_the_others_and_is_named(how):
    start = time.monotonic()
    if how == "recipe":
        with pytest.raises(RecipeError, match="does not divide") as err:
            run_ranks(_one_rank_fails, 2, how)
        assert err.value.fix == "pick tp=2"
    else:
        with pytest.raises(RuntimeError, match=r"rank 1 died without reporting \(exit code 3\)"):
            run_ranks(_one_rank_fails, 2, how)
    assert time.monotonic() - start < 60  # not the gloo timeout the waiting rank would otherwise reach


def test_the_rank_that_died_is_named_not_the_peer_it_cut_off(tmp_path):
    """Both ranks ended before the run looked (the race a loaded machine loses): rank 0's barrier failed with
    "Connection reset by peer" because rank 1 died; the cause named is rank 1's death."""
    envs, store = ranks.rank_environments(dict(os.environ), 2)
    procs = [ranks.context().Process(target=convert_ranks._entry, args=(r, _one_rank_fails, env, str(tmp_path), ("dies",)))
             for r, env in enumerate(envs)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    job = ranks.Run(procs, ["probe"], store)
    assert job.wait() != 0
    assert job.failed_ranks == [0, 1]  # the peer reported its own error before anyone looked
    assert "error" in json.loads((tmp_path / "rank0.json").read_text())
    with pytest.raises(RuntimeError, match=r"rank 1 died without reporting \(exit code 3\)"):
        convert_ranks._raise_cause(job, str(tmp_path))
