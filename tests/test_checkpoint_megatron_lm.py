"""Megatron-LM checkpoints, both ways, against a checkpoint Megatron-LM itself wrote (tests/data/megatron_lm,
made by its pretrain_gpt.py: see the README there).

- read: the model is described from the checkpoint's own ``args``; what our model cannot express is refused
  naming the argument; a ``common.pt`` holding anything beyond args is refused without running it;
- resume: model, distributed-optimizer state and LR schedule continue (Megatron-LM counts the schedule in
  samples, we count steps); the fp32 main weights loaded are the ones of the bf16 weights they belong to;
- pretrained: the same weights go into a fresh model;
- export: the HF export of the Megatron-LM checkpoint matches its logits;
- ours: every checkpoint we save carries what Megatron-LM's load_checkpoint reads first.
Megatron-Bridge's ``run_config.yaml`` is read by the same mapping.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint_support as cs
from multiproc import run_ranks

FIXTURE = Path(__file__).parent / "data" / "megatron_lm" / "tiny_llama"
ITER = FIXTURE / "iter_0000004"
# The fixture's model (see its README) on the checkpoint tests' tiny recipe: 2 layers x 64, tied embeddings
AS_FIXTURE = ["model.num_layers=2", "model.vocab_size=4096", "model.tie_embeddings=true", "precision=bf16",
              "optimizer.use_distributed_optimizer=true", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
              "optimizer.lr_warmup_iters=1", "optimizer.lr_decay_style=cosine", "train.train_iters=6"]


def _fixture_args() -> argparse.Namespace:
    from megatron_recipes.checkpoint import _foreign

    return _foreign.describe(ITER).args


def test_fixture_is_described_from_its_args():
    from megatron_recipes import checkpoint as ck
    from megatron_recipes.checkpoint import _identity

    resolved = ck.resolve(FIXTURE)  # the checkpoints root: its tracker names iteration 4
    assert resolved.name == "iter_0000004"
    meta = ck.read_meta(resolved)
    assert meta["source"] == "megatron-lm" and meta["step"] == 4
    assert meta["contents"]["optimizer_format"] == "dp_reshardable" and meta["contents"]["scheduler"]
    assert not meta["contents"]["rng"]
    assert meta["layout"]["tp"] == 1 and meta["layout"]["padded_vocab_size"] == 4096
    cfg = cs.tiny_cfg("unused", extra=AS_FIXTURE)
    ck.check_same_model(meta, cfg, resolved)  # the recipe of the same model is accepted
    fp = meta["fingerprint"]
    assert (fp["num_layers"], fp["hidden_size"], fp["num_query_groups"], fp["tie_embeddings"]) == (2, 64, 2, True)
    run = ck.read_run(FIXTURE)
    assert run.cfg.model.family == "llama" and run.cfg.precision.params_dtype == "bf16"
    assert _identity.model_fingerprint(run.cfg) == fp
    other = cs.tiny_cfg("unused", extra=AS_FIXTURE[1:])  # 4 layers
    with pytest.raises(Exception, match="num_layers: checkpoint 2, recipe 4"):
        ck.check_same_model(meta, other, resolved)


def _unsupported_cases():
    from megatron_recipes.checkpoint._foreign import megatron_lm

    table = [(argument, "set" if fine is None else True) for argument, fine, _ in megatron_lm._UNSUPPORTED]  # every row
    return table + [("normalization", "L2Norm"), ("position_embedding_type", "mrope"), ("window_size", (128, 128))]


UNSUPPORTED = _unsupported_cases()


@pytest.mark.parametrize("argument,value", UNSUPPORTED, ids=[a for a, _ in UNSUPPORTED])
def test_what_our_model_cannot_express_is_refused_naming_the_argument(argument, value):
    from megatron_recipes.checkpoint._foreign import megatron_lm
    from megatron_recipes.config.errors import RecipeError

    args = argparse.Namespace(**vars(_fixture_args()))
    megatron_lm.model_fields(args, "ckpt")  # the fixture itself is fine
    setattr(args, argument, value)
    with pytest.raises(RecipeError, match=f"--{argument.replace('_', '-')} = "):
        megatron_lm.model_fields(args, "ckpt")


def test_moe_layer_patterns_other_than_dense_first_are_refused():
    from megatron_recipes.checkpoint._foreign import megatron_lm
    from megatron_recipes.config.errors import RecipeError

    args = argparse.Namespace(**vars(_fixture_args()))
    args.num_experts, args.moe_layer_freq = 4, [0, 1]
    assert megatron_lm.model_fields(args, "ckpt")["moe_first_dense_layers"] == 1
    args.moe_layer_freq = [1, 0]  # MoE, then dense: no ModelConfig says that
    with pytest.raises(RecipeError, match="--moe-layer-freq"):
        megatron_lm.model_fields(args, "ckpt")


@pytest.mark.parametrize("model", sorted(p.stem for p in (Path(__file__).parents[1] / "recipes" / "model").glob("*.yaml")))
def test_our_args_describe_every_shipped_model_exactly(model):
    """args_for (what our checkpoints carry) and model_fields (how we read Megatron-LM's) are inverses."""
    from megatron_recipes.checkpoint import _foreign, _identity
    from megatron_recipes.checkpoint._foreign import megatron_lm
    from megatron_recipes.config.compose import compose_recipe

    cfg = compose_recipe("tiny_llama_cpu", [f"model={model}"])
    args = megatron_lm.args_for(cfg, 0, "dp_reshardable", True)
    fields = megatron_lm.model_fields(args, model)
    read_back = _foreign._model_config(fields, cfg.model.name, cfg.model.family)
    assert _identity.fingerprint_of(read_back) == _identity.model_fingerprint(cfg)
    from megatron_recipes.config import derived

    assert args.padded_vocab_size == derived.padded_vocab_size(cfg.model, cfg.parallel.tp)  # the rows Megatron-LM expects


def test_common_state_with_anything_but_args_is_refused_unrun(tmp_path):
    from megatron_recipes import checkpoint as ck
    from megatron_recipes.config.errors import RecipeError

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "sentinel"), "w"))

    crafted = tmp_path / "ckpt" / "iter_0000004"
    shutil.copytree(ITER, crafted)
    common = torch.load(ITER / "common.pt", weights_only=False)
    common["args"].tokenizer_model = Payload()
    torch.save(common, crafted / "common.pt")
    with pytest.raises(RecipeError, match="common.pt"):
        ck.read_meta(crafted)
    assert not (tmp_path / "sentinel").exists()


def test_megatron_bridge_run_config_is_read_by_the_same_mapping(tmp_path):
    import yaml

    from megatron_recipes import checkpoint as ck
    from megatron_recipes.config.errors import RecipeError

    folder = tmp_path / "bridge" / "iter_0000004"
    shutil.copytree(ITER, folder)
    args = _fixture_args()
    model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 128, "kv_channels": 16, "vocab_size": 4096, "make_vocab_size_divisible_by": 128,
             "seq_length": args.seq_length, "normalization": "RMSNorm", "layernorm_epsilon": 1e-5,
             "gated_linear_unit": True, "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
             "add_bias_linear": False, "position_embedding_type": "rope", "rotary_base": 10000, "rotary_percent": 1.0,
             "share_embeddings_and_output_weights": True, "tensor_model_parallel_size": 1}
    run_config = {"model": model, "train": {"global_batch_size": 4, "micro_batch_size": 2},
                  "optimizer": {"optimizer": "adam", "use_distributed_optimizer": True}}
    (folder / "run_config.yaml").write_text(yaml.safe_dump(run_config))
    torch.save({"step": torch.tensor(4), "consumed_train_samples": torch.tensor(16)}, folder / "train_state.pt")
    meta = ck.read_meta(folder)
    assert meta["source"] == "megatron-bridge" and meta["step"] == 4
    assert meta["fingerprint"] == ck.read_meta(ITER)["fingerprint"]  # the same model as Megatron-LM's args say
    model["activation_func"] = {"_target_": "torch.nn.functional.gelu"}  # GeGLU: not a model of ours
    other = tmp_path / "geglu" / "iter_0000004"
    shutil.copytree(folder, other)
    (other / "run_config.yaml").write_text(yaml.safe_dump(run_config))
    with pytest.raises(RecipeError, match="--gated-linear-unit"):
        ck.read_meta(other)


# --- on a process group: resume, pretrained weights, and what our saves carry ---


def _main_weights_match(optimizer) -> list:
    """(bf16 weight, fp32 main weight) pairs that disagree: a main weight loaded for another parameter."""
    bad = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for model_group, main_group in zip(part.shard_float16_groups, part.shard_fp32_from_float16_groups):
            for weight, main in zip(model_group, main_group):
                if not torch.equal(weight.detach(), main.detach().to(weight.dtype)):
                    bad.append(tuple(weight.shape))
    return bad


def _one_rank(tmp: str):
    from megatron.core import dist_checkpointing

    from megatron_recipes import checkpoint as ck

    out = {}
    cfg = cs.tiny_cfg(str(Path(tmp) / "run"), extra=AS_FIXTURE)
    t = cs.Trainer(cfg, seed=7)
    out["state"] = ck.load(FIXTURE, t.model, t.optimizer, t.scheduler, cfg=cfg)
    out["num_steps"] = t.scheduler.num_steps
    out["lr"] = t.optimizer.param_groups[0]["lr"]
    out["mismatched_main_weights"] = _main_weights_match(t.optimizer)
    moments = [v for part in [t.optimizer.optimizer] for s in part.state.values() for k, v in s.items() if k == "exp_avg"]
    out["moments_nonzero"] = bool(moments) and all(float(m.abs().sum()) > 0 for m in moments)
    out["resumed_checksum"] = cs.checksum(t.model)
    out["losses"] = t.train(5, 6)
    root = ck.checkpoints_root(cfg)
    ck.save(root, 6, t.model, t.optimizer, t.scheduler, {"step": 6, "consumed_samples": 16 + 2 * cs.GBS}, cfg, keep_last=1)
    with ck.restricted_loading():
        common = dist_checkpointing.load_common_state_dict(str(ck.iter_dir(root, 6)))
    args = common["args"]
    out["ours"] = {"checkpoint_version": common["checkpoint_version"], "iteration": common["iteration"],
                   "num_layers": args.num_layers, "consumed": args.consumed_train_samples, "no_save_rng": args.no_save_rng,
                   "tp": args.tensor_model_parallel_size, "scheduler": common["opt_param_scheduler"],
                   "own_scheduler": common["scheduler"]}
    fresh = cs.Trainer(cfg, seed=8)  # a new group: after the save that needed the first one's
    out["fresh_checksum"] = cs.checksum(fresh.model)
    ck.load_weights(FIXTURE, fresh.model, cfg)
    out["pretrained_checksum"] = cs.checksum(fresh.model)
    return out


def _cosine_lr(step: int, max_lr=1e-3, min_lr=1e-4, warmup=1, decay=6) -> float:
    progress = (step - warmup) / (decay - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.slow
def test_resume_and_pretrained_from_megatron_lm_and_our_saves_carry_its_keys(tmp_path):
    (out,) = run_ranks(_one_rank, 1, str(tmp_path))
    assert out["state"]["step"] == 4 and out["state"]["consumed_samples"] == 16  # 4 iterations x 4 samples
    assert out["num_steps"] == 4  # Megatron-LM's 16 samples, counted in our steps
    assert out["lr"] == pytest.approx(_cosine_lr(4), rel=1e-6)  # this recipe's schedule, continued at step 4
    assert out["mismatched_main_weights"] == []
    assert out["moments_nonzero"]  # Adam's moments came back (4 steps of them), not zeros
    assert out["pretrained_checksum"] == out["resumed_checksum"] != out["fresh_checksum"]
    assert all(math.isfinite(x) for x in out["losses"])
    ours = out["ours"]
    assert ours["checkpoint_version"] == 3.0 and ours["iteration"] == 6 and ours["num_layers"] == 2
    assert ours["consumed"] == 24 and ours["no_save_rng"] and ours["tp"] == 1
    assert ours["scheduler"]["num_steps"] == 6 * cs.GBS == ours["own_scheduler"]["num_steps"] * cs.GBS


def _fresh_env() -> dict:
    """This process's environment without a rendezvous an earlier test left in it (a stale MASTER_PORT)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.slow
def test_export_of_the_megatron_lm_checkpoint_matches_its_logits(tmp_path):
    from cli_support import run_cli

    done = run_cli(["convert", "export", f"ckpt_dir={FIXTURE}", f"hf_dir={tmp_path / 'hf'}", "--verify"], timeout=600,
                   env=_fresh_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("HF vs checkpoint"))
    assert row.split()[-1] == "ok" and float(row.split()[-5]) < 1e-4, row
    import json

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True


# --- Megatron-LM's own load_checkpoint on a checkpoint of ours (needs a Megatron-LM checkout) ---

MLM_ENV = "MEGATRON_LM_DIR"
# the model of AS_FIXTURE on checkpoint_support's tiny recipe, as Megatron-LM's arguments
MLM_MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 128 --seq-length 16 --max-position-embeddings 64 --micro-batch-size 1 "
             "--global-batch-size 4 --tokenizer-type NullTokenizer --vocab-size 4095 --mock-data --split 1,0,0 "
             "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--transformer-impl local --use-distributed-optimizer --bf16 --ckpt-format torch_dist "
             "--distributed-backend gloo --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
             "--no-bias-swiglu-fusion --no-rope-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
             "--eval-iters 0 --eval-interval 100 --log-interval 1 --lr 1e-3 --min-lr 1e-4 --weight-decay 0.01")


def _ours_at_step_3(tmp: str):
    from megatron_recipes import checkpoint as ck

    cfg = cs.tiny_cfg(str(Path(tmp) / "ours"), extra=AS_FIXTURE + ["checkpoint.optimizer_format=fully_reshardable"])
    t = cs.Trainer(cfg, seed=3)
    t.train(1, 3)
    root = ck.checkpoints_root(cfg)
    ck.save(root, 3, t.model, t.optimizer, t.scheduler, {"step": 3, "consumed_samples": 3 * cs.GBS}, cfg, keep_last=1)
    return str(root)


def _tensors(folder: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, by key (read whole, on one process)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_recipes.checkpoint import restricted_loading

    with restricted_loading():
        reader = FileSystemReader(str(folder))
        md = reader.read_metadata().state_dict_metadata
        wanted = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
                  if isinstance(m, TensorStorageMetadata)}
        load(wanted, storage_reader=reader, no_dist=True)
    return wanted


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(MLM_ENV), reason=f"{MLM_ENV} names no Megatron-LM checkout "
                    "(a checkout whose megatron/training matches the installed megatron-core)")
def test_megatron_lm_load_checkpoint_resumes_ours(tmp_path):
    """Megatron-LM resumes our step-3 checkpoint (weights, fully_reshardable optimizer state, LR schedule and
    consumed samples from our args), trains no step (train_iters=3) and saves it again: its save holds our
    tensors, bit for bit, and our progress."""
    from megatron.core import dist_checkpointing

    from megatron_recipes import checkpoint as ck

    (root,) = run_ranks(_ours_at_step_3, 1, str(tmp_path))
    out = tmp_path / "mlm"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(Path(__file__).parent / "megatron_lm_shim.py"), *MLM_MODEL.split(), "--load", root, "--save", str(out),
               "--save-interval", "2", "--train-iters", "3", "--use-checkpoint-opt_param-scheduler", "--no-load-rng",
               "--dist-ckpt-optim-fully-reshardable", "--exit-on-missing-checkpoint"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_fresh_env())
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "successfully loaded checkpoint from" in log and "at iteration 3" in log, log[-3000:]
    ours, theirs = _tensors(Path(root) / "iter_0000003"), _tensors(out / "iter_0000003")
    model_keys = [k for k in ours if k.startswith(("embedding.", "decoder.", "output_layer."))]
    optimizer_keys = [k for k in ours if k.startswith("optimizer.")]
    assert model_keys and optimizer_keys
    for key in model_keys + optimizer_keys:
        assert key in theirs, key
        assert torch.equal(ours[key], theirs[key]), key
    with ck.restricted_loading():
        common = dist_checkpointing.load_common_state_dict(str(out / "iter_0000003"))
    assert common["iteration"] == 3 and common["args"].consumed_train_samples == 3 * cs.GBS
    assert common["opt_param_scheduler"]["num_steps"] == 3 * cs.GBS
    assert common["opt_param_scheduler"]["lr_decay_steps"] == 6 * cs.GBS
