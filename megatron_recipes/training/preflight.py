"""What a run checks before any rank starts: the rule table, what this machine can honour, and every input
the run will read (data files and their vocabulary, start checkpoints, the checkpoints folder, the steps
left). A refusal here costs seconds; the same problem found by the ranks costs a queue wait and a job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.models import capabilities
from megatron_recipes.peft.state import peft_active
from megatron_recipes.training import optim, tracking


class NothingToTrain(Exception):
    """The checkpoint a start resumes is already at ``train.train_iters``: the start changes nothing and
    exits 0 (a requeue of a finished job must succeed, and must not rewrite the finished run's record)."""


def validate(cfg: RunConfig, recipe: str) -> None:
    """The recipe rules, what this machine can honour, and the inputs the run will read."""
    from megatron_recipes.validation.validate import validate_or_raise

    validate_or_raise(cfg, recipe)
    capabilities.require_supported(cfg)
    preflight(cfg)


def preflight(cfg: RunConfig) -> None:
    """Inputs a run needs, checked before any rank starts: optimizer mapping, data files, start weights."""
    from megatron_recipes.data.indexed import check_fits_vocab, check_indexed_prefix
    from megatron_recipes.data.pretrain import resolve_blends

    if cfg.checkpoint.save:  # before anything slow: a read-only folder fails here, not at the first save
        checkpoint.require_writable(checkpoint.checkpoints_root(cfg))
    optim.optimizer_config(cfg)
    tracking.check_installed(cfg)  # an explicitly asked-for W&B / MLflow must be installed
    if cfg.data.kind in ("builtin", "indexed"):
        blend, per_split = resolve_blends(cfg)  # builds (once) or finds the built-in corpus
        for b in [blend, *(per_split or [])]:
            for prefix in (b[0] if b else []):
                check_fits_vocab(check_indexed_prefix(prefix), cfg.model.vocab_size)
    start = checkpoint.start_of(cfg, adapters_only=peft_active(cfg))  # a checkpoint.load path must be complete
    if start.resume_from is not None and cfg.train.train_iters > 0:  # a seed run (0) has its own check
        check_steps_left(cfg, start.resume_from)
    if start.weights is not None:  # and so must the weights it starts from
        try:
            checkpoint.resolve(start.weights)
        except RecipeError as exc:
            raise RecipeError(
                f"checkpoint.pretrained={cfg.checkpoint.pretrained}: {exc.message}", fix=_producer_hint(cfg) or exc.fix
            ) from None


def check_steps_left(cfg: RunConfig, resume_from: Path) -> None:
    """A start that would resume at or past ``train.train_iters`` trains nothing: say so before anything in
    the run dir is touched (its config.yaml, log and report describe the run as it was trained)."""
    done = int(checkpoint.read_meta(resume_from).get("step", 0))
    target = cfg.train.train_iters
    if done < target:
        return
    others = (f"to train from scratch (another layout, another length), give it its own run dir: run.dir=<new "
              f"folder>; to start from these weights there: checkpoint.pretrained={resume_from}")
    if done == target:
        raise NothingToTrain(
            f"nothing to train: {resume_from} is at step {done} = train.train_iters; the run dir is left as it "
            f"was (to train on, raise train.train_iters; {others})"
        )
    raise RecipeError(
        f"run.dir={cfg.run.dir} resumes {resume_from} at step {done}, past train.train_iters={target}; training "
        "would do nothing and the run record would claim the new setting",
        fix=f"raise train.train_iters above {done} to train on; rewind with checkpoint.load=<an earlier "
        f"iter_* folder>; or {others}",
    )


def _producer_hint(cfg: RunConfig) -> Optional[str]:
    """For a start checkpoint under ``runs/<recipe>/checkpoints``: the command that writes it."""
    from megatron_recipes.config.compose import list_recipes

    path = Path(cfg.checkpoint.pretrained)
    if path.name != checkpoint.CHECKPOINTS or path.parent.name not in list_recipes():
        return None
    return (
        f"run the job that writes it first: `megatron-recipes train {path.parent.name}` (run from this folder), "
        f"or set checkpoint.pretrained=<your checkpoint>"
    )
