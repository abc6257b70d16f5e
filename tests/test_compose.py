"""Recipe composition: bad input fails with one readable RecipeError; every shipped recipe composes
and passes every validation rule on its own cluster."""

from __future__ import annotations

import pytest

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe, from_yaml, list_group_options, list_recipes, to_yaml
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.validate import validate

SHIPPED = [
    "llama3_8b_pretrain",
    "llama3_70b_pretrain",
    "llama31_405b_pretrain",
    "mixtral_8x7b_pretrain",
    "qwen3_30b_a3b_pretrain",
    "qwen3_235b_a22b_pretrain",
    "deepseek_v3_pretrain",
    "tiny_llama_cpu",
]


def _error(recipe: str, overrides=()) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        compose_recipe(recipe, list(overrides))
    return info.value


def test_shipped_recipes_are_listed():
    assert set(SHIPPED) <= set(list_recipes())


@pytest.mark.parametrize("recipe", SHIPPED)
def test_shipped_recipe_composes_and_validates(recipe):
    cfg = compose_recipe(recipe)
    assert isinstance(cfg, RunConfig)
    assert validate(cfg) == [], f"{recipe} violates: {[v.render() for v in validate(cfg)]}"
    assert derived.data_parallel_size(cfg) >= 1


# Inputs only the user can give (data files, a base checkpoint): a shipped recipe may leave these open.
USER_INPUT_RULES = {"data.indexed_needs_blend", "data.sft_needs_path", "peft.needs_pretrained"}
USER_INPUTS = ["data.sft_path=train.jsonl", "checkpoint.pretrained=base_ckpt"]


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_in_the_tree_is_valid_once_user_inputs_are_given(recipe):
    cfg = compose_recipe(recipe)
    open_inputs = {v.rule_id for v in validate(cfg)}
    assert open_inputs <= USER_INPUT_RULES, f"{recipe}: {open_inputs - USER_INPUT_RULES}"
    if open_inputs:
        given = compose_recipe(recipe, USER_INPUTS)
        assert [v.render() for v in validate(given) if v.rule_id != "data.indexed_needs_blend"] == []


def test_model_configs_match_published_sizes():
    """A few architecture numbers as published (the planner's parameter count is tested elsewhere)."""
    from megatron_recipes.estimate.params import active_params, model_params

    expect = {  # total, active, in billions, within 1%
        "llama3_8b_pretrain": (8.03, 8.03),
        "llama3_70b_pretrain": (70.6, 70.6),
        "llama31_405b_pretrain": (405.9, 405.9),
        "mixtral_8x7b_pretrain": (46.7, 12.9),
        "qwen3_30b_a3b_pretrain": (30.5, 3.3),
        "qwen3_235b_a22b_pretrain": (235.1, 22.2),
    }
    for recipe, (total, active) in expect.items():
        cfg = compose_recipe(recipe)
        assert model_params(cfg).total / 1e9 == pytest.approx(total, rel=0.01), recipe
        assert active_params(cfg) / 1e9 == pytest.approx(active, rel=0.02), recipe
    qwen25 = compose_recipe("llama3_8b_pretrain", ["model=qwen25_7b"])
    assert model_params(qwen25).total / 1e9 == pytest.approx(7.62, rel=0.01)
    dsv3 = compose_recipe("deepseek_v3_pretrain")  # 671B main model + one MTP layer
    assert 671 < model_params(dsv3).total / 1e9 < 690
    assert dsv3.model.init_method_std == 0.006  # DeepSeek-V3 technical report, section 4.2 (Megatron-Bridge agrees)


def test_overrides_reach_the_typed_config():
    cfg = compose_recipe("llama3_70b_pretrain", ["parallel.tp=8", "cluster.nodes=16", "parallel.vpp=null", "cluster=h200_8gpu"])
    assert (cfg.parallel.tp, cfg.cluster.nodes, cfg.parallel.vpp, cfg.cluster.name) == (8, 16, None, "h200_8gpu")
    assert isinstance(cfg.parallel.sp, bool) and isinstance(cfg.optimizer.lr, float)


def test_unknown_key():
    err = _error("tiny_llama_cpu", ["parallel.tensor_parallel=2"])
    assert "tensor_parallel" in err.message and "--show-config" in (err.fix or "")


def test_wrong_type():
    err = _error("tiny_llama_cpu", ["parallel.tp=two"])
    assert "parallel.tp" in err.message or "tp" in err.message
    assert "two" in err.message and err.fix


def test_unknown_recipe_suggests_close_names():
    err = _error("llama3_70b_pretrian")
    assert "unknown recipe 'llama3_70b_pretrian'" in err.message and "llama3_70b_pretrain" in err.fix


def test_missing_recipe_file():
    err = _error("no/such/recipe.yaml")
    assert "does not exist" in err.message


@pytest.mark.parametrize("group,bad", [("cluster", "h100_16gpu"), ("model", "llama4"), ("precision", "fp6")])
def test_unknown_group_option(group, bad):
    err = _error("tiny_llama_cpu", [f"{group}={bad}"])
    assert bad in err.message
    for option in list_group_options(group)[:2]:
        assert option in err.fix


def test_override_syntax():
    err = _error("tiny_llama_cpu", ["parallel.tp"])
    assert "not an override" in err.message and "key=value" in err.fix
    err = _error("tiny_llama_cpu", ["parallel.tp=[1,2"])
    assert err.message


def test_missing_required_values(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "defaults:\n  - run_schema\n  - model: tiny_llama\n  - cluster: local_cpu\n  - precision: fp32\n"
        "  - data: builtin\n  - optimizer: adam\n  - _self_\nrun:\n  dir: runs/mine\n"
        "train:\n  global_batch_size: 8\n  micro_batch_size: 4\n"
    )
    err = _error(str(recipe))
    assert "train.seq_length" in err.message and "train.train_iters" in err.message
    cfg = compose_recipe(str(recipe), ["train.seq_length=64", "train.train_iters=3000"])
    assert validate(cfg) == []


def test_user_recipe_file_reuses_shipped_groups(tmp_path):
    recipe = tmp_path / "mixtral_small.yaml"
    recipe.write_text("defaults:\n  - mixtral_8x7b_pretrain\n  - _self_\ncluster:\n  nodes: 4\ntrain:\n  global_batch_size: 128\n")
    cfg = compose_recipe(str(recipe))
    assert cfg.model.name == "mixtral_8x7b" and cfg.cluster.nodes == 4


def test_a_kept_composition_follows_the_files_and_the_environment(tmp_path, monkeypatch):
    """compose_recipe keeps what it composed: an edited recipe, an edited group option in a search path and an
    environment variable the recipe reads each still change the result, and each caller gets its own copy."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - tiny_llama_cpu\n  - _self_\ntrain:\n  train_iters: 7\n")
    first = compose_recipe(str(recipe))
    first.train.train_iters = 99  # the caller's copy: not what the next caller gets
    assert compose_recipe(str(recipe)).train.train_iters == 7
    recipe.write_text("defaults:\n  - tiny_llama_cpu\n  - _self_\ntrain:\n  train_iters: 8\n")
    assert compose_recipe(str(recipe)).train.train_iters == 8
    (tmp_path / "model").mkdir()
    option = tmp_path / "model" / "mini.yaml"
    option.write_text("defaults:\n  - tiny_llama\n  - _self_\nname: mini\nnum_layers: 2\n")
    searched = [f"hydra.searchpath=[file://{tmp_path}]", "model=mini"]
    assert compose_recipe("tiny_llama_cpu", searched).model.num_layers == 2
    option.write_text("defaults:\n  - tiny_llama\n  - _self_\nname: mini\nnum_layers: 3\n")
    assert compose_recipe("tiny_llama_cpu", searched).model.num_layers == 3
    recipe.write_text("defaults:\n  - tiny_llama_cpu\n  - _self_\ntrain:\n  train_iters: ${oc.env:MINE_ITERS}\n")
    monkeypatch.setenv("MINE_ITERS", "5")
    assert compose_recipe(str(recipe)).train.train_iters == 5
    monkeypatch.setenv("MINE_ITERS", "6")
    assert compose_recipe(str(recipe)).train.train_iters == 6


def test_resolved_config_round_trips(tmp_path):
    cfg = compose_recipe("deepseek_v3_pretrain")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert from_yaml(path) == cfg
