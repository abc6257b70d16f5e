"""HF <-> Megatron conversion of every family, proven by logits and bit-exact round trips.

For each family a tiny random HF model is imported at TP=1 and at TP=2 x PP=2 (x EP=2 for MoE), then:
(a) megatron-core's float32 logits (real gloo ranks, our builder and load_weights) are within 1e-4
    max-abs of transformers' on a fixed prompt batch, at both layouts;
(b) import -> export gives bit-identical float32 tensors and the same config.json;
(c) the TP=1 import, loaded at TP=2 x PP=2 (x EP=2) and saved there by the trainer's checkpoint engine,
    exports bit-identical tensors again, and without the original config.json the derived one gives
    transformers the same logits.
All megatron-side work of a layout runs in one process group (one spawn of 4 ranks for every family).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from convert_support import FAMILIES, MOE, assert_same_tensors, config_differences, make_hf_model
from megatron_recipes.config.schema import ParallelConfig
from megatron_recipes.convert import verify
from megatron_recipes.convert.exporter import run_export
from megatron_recipes.convert.importer import HF_ASSETS, run_import

pytestmark = pytest.mark.slow


def layout_b(family: str) -> ParallelConfig:
    return ParallelConfig(tp=2, pp=2, ep=2, etp=1) if family in MOE else ParallelConfig(tp=2, pp=2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    w = SimpleNamespace(root=root, hf={}, tp1={}, big={}, resaved={}, tokens={}, logits_tp1={}, logits_big={}, logits_b_from_tp1={})
    for fam in FAMILIES:
        w.hf[fam] = make_hf_model(fam, root / f"hf_{fam}")
        w.tp1[fam] = run_import(w.hf[fam], root / f"tp1_{fam}", ParallelConfig(), progress=False).out_dir
        w.big[fam] = run_import(w.hf[fam], root / f"big_{fam}", layout_b(fam), progress=False).out_dir
        tokens = verify.prompt_tokens(1000)
        w.tokens[fam] = root / f"tokens_{fam}.pt"
        torch.save(tokens, w.tokens[fam])
        w.resaved[fam] = root / f"resaved_{fam}"

    # one rank: every TP=1 import at TP=1 (in this process)
    jobs1 = []
    for fam in FAMILIES:
        w.logits_tp1[fam] = root / f"logits_tp1_{fam}.pt"
        jobs1.append(verify.Job(str(w.tp1[fam]), ParallelConfig(), str(w.tokens[fam]), str(w.logits_tp1[fam])))
    verify.rank_jobs(jobs1, 1)

    # four ranks: the layout-B imports at layout B; the TP=1 imports loaded at layout B and saved again
    jobs4 = []
    for fam in FAMILIES:
        w.logits_big[fam] = root / f"logits_big_{fam}.pt"
        w.logits_b_from_tp1[fam] = root / f"logits_b_from_tp1_{fam}.pt"
        jobs4.append(verify.Job(str(w.big[fam]), layout_b(fam), str(w.tokens[fam]), str(w.logits_big[fam])))
        jobs4.append(
            verify.Job(str(w.tp1[fam]), layout_b(fam), str(w.tokens[fam]), str(w.logits_b_from_tp1[fam]), str(w.resaved[fam]))
        )
    verify.run_jobs(jobs4, 4, moe=True)  # mixtral, qwen3_moe and deepseek_v3 among them
    return w


def _reference(w, fam: str) -> torch.Tensor:
    return verify.hf_logits(w.hf[fam], torch.load(w.tokens[fam]))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_at_tp1_and_tp2_pp2(world, family):
    reference = _reference(world, family)
    for label, path in (("tp1", world.logits_tp1[family]), ("tp2xpp2", world.logits_big[family]),
                        ("tp1 import at tp2xpp2", world.logits_b_from_tp1[family])):
        m = verify.compare(reference, torch.load(path))
        assert m.max_abs <= verify.TOLERANCE, f"{family} {label}: {m}"
        assert m.argmax_agreement == 1.0, f"{family} {label}: {m}"


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_is_bit_identical(world, family, tmp_path):
    for source in (world.tp1[family], world.big[family]):
        out = tmp_path / f"export_{source.name}"
        run_export(source, out, progress=False)
        assert_same_tensors(world.hf[family], out)
        assert config_differences(world.hf[family], out) == {}
        assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_resharded_checkpoint_exports_bit_identical(world, family, tmp_path):
    resaved = world.resaved[family]
    with_assets = tmp_path / "with_assets"
    run_export(resaved, with_assets, hf_assets=world.tp1[family] / HF_ASSETS, progress=False)
    assert_same_tensors(world.hf[family], with_assets)
    assert config_differences(world.hf[family], with_assets) == {}

    derived = tmp_path / "derived_config"  # no original config.json: derived from the checkpoint alone
    report = run_export(resaved, derived, progress=False)
    assert report.assets_from is None
    assert_same_tensors(world.hf[family], derived)
    tokens = torch.load(world.tokens[family])
    m = verify.compare(_reference(world, family), verify.hf_logits(derived, tokens))
    assert m.max_abs <= 1e-6, m
