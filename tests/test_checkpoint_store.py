"""Checkpoint folder rules without processes: completeness, latest, retention, identity checks.

Folders here are built by hand (megatron-core's files as empty stand-ins) to reach states a real save
leaves only when killed at a precise moment; test_checkpoint_errors/_kill cover real saves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.checkpoint import _identity as identity
from megatron_recipes.checkpoint import _mcore as io
from megatron_recipes.checkpoint import _files as store


def _fake(root: Path, step: int, *, name=None, meta=True, complete=True, mcore=None, writer="0.16.1") -> Path:
    """A folder as a save leaves it; ``writer``: the megatron-core release meta.json says wrote it."""
    path = root / (name or f"iter_{step:07d}")
    path.mkdir(parents=True)
    body = {"format": store.FORMAT, "format_version": store.FORMAT_VERSION, "complete": complete, "step": step,
            "megatron_core_version": writer}
    for f in store.mcore_files(body) if mcore is None else mcore:
        (path / f).write_bytes(b"x")
    if meta:
        (path / store.META).write_text(json.dumps(body))
    return path


def test_common_pt_is_required_only_from_the_releases_that_write_it(tmp_path):
    """megatron-core up to 0.18 writes common.pt; 0.19 keeps the common state inside the .distcp files, so
    a 0.19 save without common.pt is complete, a 0.16-0.18 one is not (nor one from before meta.json
    recorded the release: those were 0.16's)."""
    both = ("metadata.json", ".metadata")
    assert store.is_complete(_fake(tmp_path, 1, writer="0.19.2", mcore=both))
    for step, writer in ((2, "0.16.1"), (3, "0.18.2"), (4, None)):
        assert store.problems(_fake(tmp_path, step, writer=writer, mcore=both)) == ["megatron-core files missing: common.pt"]
    assert store.problems(_fake(tmp_path, 5, writer="0.19.2", mcore=(".metadata",))) == [
        "megatron-core files missing: metadata.json"
    ]


def test_latest_takes_only_complete_folders(tmp_path):
    assert store.latest(tmp_path / "nothing-here") is None
    assert store.latest(tmp_path) is None
    _fake(tmp_path, 100)
    good = _fake(tmp_path, 200)
    _fake(tmp_path, 300, name="iter_0000300.incomplete")  # killed after meta, before the rename
    _fake(tmp_path, 400, meta=False)  # killed mid-write
    _fake(tmp_path, 500, mcore=("common.pt",))  # megatron-core's index never written
    _fake(tmp_path, 600, complete=False)
    _fake(tmp_path, 700, name="iter_0000701")  # name and meta disagree
    _fake(tmp_path, 800, name="iter_0000800.deleting")
    store.write_tracker(tmp_path, 500)  # a tracker that names a broken folder is not trusted either
    assert store.latest(tmp_path) == good
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [100, 200]


def test_latest_is_the_trackers_answer_when_it_names_a_complete_checkpoint(tmp_path):
    # Before: the newest complete folder won over the tracker, so after a rewind to 100 the abandoned 200
    # was resumed by the next plain start. A save killed between its rename and the tracker update is now
    # trained again from the tracked one (as Megatron-LM's loader, which reads the tracker, does).
    tracked = _fake(tmp_path, 100)
    newest = _fake(tmp_path, 200)
    store.write_tracker(tmp_path, 100)
    assert store.latest(tmp_path) == tracked
    store.write_tracker(tmp_path, 150)  # a tracker naming no complete folder: the newest complete one
    assert store.latest(tmp_path) == newest
    (tmp_path / store.TRACKER).unlink()
    assert store.latest(tmp_path) == newest


def test_a_rewind_is_tracked_and_its_start_survives_retention_until_the_branch_overtakes(tmp_path):
    for step in (100, 200, 300):
        _fake(tmp_path, step)
    store.write_tracker(tmp_path, 300)
    assert not store.record_resume(tmp_path, 300)  # a plain continuation
    assert store.record_resume(tmp_path, 200)  # checkpoint.load=.../iter_0000200
    assert store.latest(tmp_path) == store.iter_dir(tmp_path, 200) and store.read_resumed(tmp_path) == 200
    assert not store.record_resume(tmp_path, 200)  # a requeue of the rewound run: still protected
    _fake(tmp_path, 250)
    store.write_tracker(tmp_path, 250)
    store.prune(tmp_path, keep_last=2)
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [200, 250, 300]
    assert store.latest(tmp_path) == store.iter_dir(tmp_path, 250)
    _fake(tmp_path, 260)
    store.write_tracker(tmp_path, 260)
    store.prune(tmp_path, keep_last=2)
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [200, 260, 300]
    store._remove(store.iter_dir(tmp_path, 300))  # the branch's own save of step 300 replaced the abandoned one
    _fake(tmp_path, 300)
    store.write_tracker(tmp_path, 300)
    store.prune(tmp_path, keep_last=2)
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [260, 300] and store.read_resumed(tmp_path) is None


def test_prune_keeps_last_k_and_drops_leftovers(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _fake(tmp_path, step)
    _fake(tmp_path, 6, name="iter_0000006.incomplete", meta=False)
    _fake(tmp_path, 0, name="iter_0000000.deleting")
    removed = store.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000005"]
    assert len(removed) == 5
    store.prune(tmp_path, keep_last=0)  # 0 keeps every complete checkpoint
    assert len(list(tmp_path.iterdir())) == 2


def test_publish_replaces_an_older_save_of_the_same_step(tmp_path):
    old = _fake(tmp_path, 7)
    (old / "stale").write_text("old")
    staging = store.prepare_staging(tmp_path, 7)
    for f in store.MCORE_FILES + ("common.pt",):
        (staging / f).write_bytes(b"new")
    (staging / store.META).write_text(json.dumps({"format": store.FORMAT, "complete": True, "step": 7}))
    store.publish(staging, store.iter_dir(tmp_path, 7))
    assert not staging.exists() and not (old / "stale").exists()
    assert store.is_complete(store.iter_dir(tmp_path, 7))


def test_resolve_dir_errors_name_the_problem(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        store.resolve_dir(tmp_path / "missing")
    with pytest.raises(RecipeError, match="no complete checkpoint"):
        store.resolve_dir(tmp_path)
    broken = _fake(tmp_path, 3, mcore=("common.pt",))
    with pytest.raises(RecipeError, match=r"missing: metadata\.json, \.metadata"):
        store.resolve_dir(broken)
    staging = _fake(tmp_path, 4, name="iter_0000004.incomplete")
    with pytest.raises(RecipeError, match="did not finish"):
        store.resolve_dir(staging)
    good = _fake(tmp_path, 2)
    assert store.resolve_dir(good) == good
    assert store.resolve_dir(tmp_path) == good  # a checkpoints root resolves to its latest complete folder


def test_meta_must_be_ours_and_readable(tmp_path):
    bad = tmp_path / "iter_0000001"
    bad.mkdir()
    (bad / store.META).write_text("{not json")
    with pytest.raises(RecipeError, match="cannot be read"):
        store.read_meta(bad)
    (bad / store.META).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(RecipeError, match="not a megatron-recipes checkpoint"):
        store.read_meta(bad)
    (bad / store.META).write_text(json.dumps({"format": store.FORMAT, "format_version": 99}))
    with pytest.raises(RecipeError, match="upgrade"):
        store.read_meta(bad)


def test_write_atomic_leaves_no_temp_files(tmp_path):
    target = tmp_path / "latest_checkpointed_iteration.txt"
    store.write_tracker(tmp_path, 5)
    store.write_tracker(tmp_path, 6)
    assert target.read_text() == "6\n" and store.read_tracker(tmp_path) == 6
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_state_must_reload_with_weights_only():
    io.check_plain({"step": 3, "consumed": 12, "data": {"offsets": [1, 2], "t": torch.ones(2)}, "none": None})
    with pytest.raises(RecipeError, match=r"state\['rng'\]\['numpy'\] holds a numpy.ndarray"):
        io.check_plain({"rng": {"numpy": np.zeros(3)}})


@pytest.fixture(scope="module")
def cfg():
    from megatron_recipes.config.compose import compose_recipe

    return compose_recipe("tiny_llama_cpu", ["run.dir=unused"])


def _meta_of(cfg_):
    return {"fingerprint": identity.model_fingerprint(cfg_), "layout": identity.layout(cfg_)}


def test_fingerprint_names_every_differing_field(cfg):
    import copy

    other = copy.deepcopy(cfg)
    other.model.hidden_size *= 2
    other.model.num_layers += 1
    other.model.name, other.model.family, other.model.init_method_std = "renamed", "mistral", 0.5  # not weights
    with pytest.raises(RecipeError) as err:
        identity.check_same_model(_meta_of(cfg), other, "ckpt")
    message = str(err.value)
    assert "model.hidden_size: checkpoint 128, recipe 256" in message
    assert "model.num_layers: checkpoint 4, recipe 5" in message
    assert "2 field(s) differ" in message
    relabelled = copy.deepcopy(cfg)
    relabelled.model.name = "renamed"
    relabelled.parallel.tp = 1  # another layout of the same model is fine
    identity.check_same_model(_meta_of(cfg), relabelled, "ckpt")


def test_padded_vocabulary_mismatch_suggests_a_divisor(cfg):
    import copy

    saved = copy.deepcopy(cfg)
    saved.model.vocab_size = 300  # TP=2 pads to a multiple of 256 -> 512 rows
    now = copy.deepcopy(saved)
    now.parallel.tp = 1  # TP=1 pads to a multiple of 128 -> 384 rows
    with pytest.raises(RecipeError) as err:
        identity.check_same_model(_meta_of(saved), now, "ckpt")
    assert "512 embedding rows" in str(err.value) and "384" in str(err.value)
    assert err.value.fix.startswith("set model.make_vocab_size_divisible_by=256")
    now.model.make_vocab_size_divisible_by = 256
    identity.check_same_model(_meta_of(saved), now, "ckpt")


def test_rng_is_restored_only_on_the_same_ranks(cfg):
    lay = identity.layout(cfg)
    assert identity.same_ranks(lay, dict(lay))
    assert not identity.same_ranks(lay, dict(lay, tp=1, dp=2))
    assert identity.model_parallel_changed(lay, dict(lay, pp=2)) == ["pp: 1 -> 2"]


def test_retention_never_removes_the_checkpoint_the_save_just_wrote(tmp_path, cfg):
    # Before: a seed run (train.train_iters=0) in a run dir holding iter_300 and iter_400 (keep_last=2) wrote
    # iter_0, retention by step order deleted it, and the run printed "seed checkpoint written: .../iter_0000000".
    from megatron_recipes.checkpoint import _save_load

    for step in (300, 400):
        _fake(tmp_path, step)
    store.write_tracker(tmp_path, 400)
    staging = store.prepare_staging(tmp_path, 0)
    for name in store.MCORE_FILES + ("common.pt",):  # as a 0.16-0.18 save leaves it
        (staging / name).write_bytes(b"x")
    meta = {"format": store.FORMAT, "format_version": store.FORMAT_VERSION, "complete": True, "step": 0}
    seed = _save_load._finish(tmp_path, 0, meta, cfg, keep_last=2)
    assert store.is_complete(seed) and store.read_tracker(tmp_path) == 0
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [0, 300, 400]  # nothing else removed either
    _fake(tmp_path, 500)
    store.write_tracker(tmp_path, 500)  # the run goes on: ordinary retention again
    store.prune(tmp_path, keep_last=2)
    assert [s for s, _ in store.complete_checkpoints(tmp_path)] == [400, 500]


def test_a_checkpoint_without_common_pt_is_refused_by_a_release_that_needs_it(tmp_path):
    """A 0.19 save (no common.pt) loaded where megatron-core reads only common.pt: a RecipeError naming both
    releases and the fix, not megatron-core's FileNotFoundError; a 0.16 save loads everywhere."""
    from megatron_recipes.runtime import mcore_compat

    new = _fake(tmp_path, 1, writer="0.19.2")
    old = _fake(tmp_path, 2, writer="0.16.1")
    store.require_readable_here(old, store.read_meta(old))
    if mcore_compat.reads_common_state_from_distcp():
        store.require_readable_here(new, store.read_meta(new))
    else:
        with pytest.raises(RecipeError, match=r"written by megatron-core 0\.19\.2.*common\.pt") as err:
            store.require_readable_here(new, store.read_meta(new))
        assert "pip install 'megatron-core>=0.19" in err.value.render()


def test_a_run_dir_resolves_to_its_latest_checkpoint(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RecipeError, match="no complete checkpoint"):
        store.resolve_dir((run / store.CHECKPOINTS).mkdir(parents=True) or run)
    _fake(run / store.CHECKPOINTS, 1)
    newest = _fake(run / store.CHECKPOINTS, 5)
    assert store.resolve_dir(run) == newest  # what train writes under run.dir, as generate/export/eval are given it
