"""Recipe name + Hydra overrides -> typed ``RunConfig``.

Composition goes through Hydra's compose API against the ``recipes/`` tree (shipped inside the wheel
as ``megatron_recipes._recipes``), with the schema dataclasses registered in the ConfigStore so unknown
keys and wrong types fail here, before anything starts.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Iterable, List, Sequence

from omegaconf import DictConfig, OmegaConf

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

SCHEMA_NAME = "run_schema"
_registered = False


def recipes_dir() -> Path:
    """The folder holding the recipe tree, whether running from a checkout or an installed wheel."""
    env = os.environ.get("MEGATRON_RECIPES_DIR")
    if env:
        return Path(env).resolve()
    try:
        shipped = resources.files("megatron_recipes._recipes")
        path = Path(str(shipped))
        if path.is_dir() and (path / "model").is_dir():
            return path.resolve()
    except (ModuleNotFoundError, TypeError):
        pass
    return (Path(__file__).resolve().parents[2] / "recipes").resolve()


def _register_schema() -> None:
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
    _registered = True


def list_recipes() -> List[str]:
    """Experiment recipes: the top-level YAML files of the recipe tree."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def list_group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (recipes_dir() / group).glob("*.yaml"))


def _unknown_recipe(name: str) -> RecipeError:
    known = list_recipes()
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return RecipeError(
        f"unknown recipe '{name}'",
        fix=f"{hint}known recipes: {', '.join(known)}; or pass a path to your own recipe .yaml",
    )


def compose_dict(recipe: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a recipe into a (typed) DictConfig; raises RecipeError with a readable message."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    overrides = list(overrides)
    base = recipes_dir()
    candidate = Path(recipe)
    if recipe.endswith((".yaml", ".yml")):
        if not candidate.is_file():
            raise RecipeError(f"recipe file '{recipe}' does not exist", fix="check the path")
        config_dir, name = candidate.resolve().parent, candidate.stem
        overrides = [f"hydra.searchpath=[file://{base}]"] + overrides
    else:
        if not (base / f"{recipe}.yaml").is_file():
            raise _unknown_recipe(recipe)
        config_dir, name = base, recipe
    _check_override_syntax(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides)
    except MissingConfigException as exc:
        raise RecipeError(_first_line(exc), fix=_group_option_hint(str(exc))) from None
    except (ConfigCompositionException, HydraException, OmegaConfBaseException) as exc:
        raise RecipeError(_describe_compose_error(exc), fix=_fix_for_compose_error(exc)) from None
    return cfg


def compose_recipe(recipe: str, overrides: Sequence[str] = ()) -> RunConfig:
    """The typed, fully resolved recipe. Missing required values are reported by key."""
    cfg = compose_dict(recipe, overrides)
    missing = sorted(_missing_keys(cfg))
    if missing:
        raise RecipeError(
            f"recipe '{recipe}' leaves required keys unset: {', '.join(missing)}",
            fix="set them in the recipe or on the command line, e.g. " + " ".join(f"{k}=..." for k in missing[:3]),
        )
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # omegaconf validation errors carry the key in their message
        raise RecipeError(f"recipe '{recipe}' does not match the schema: {exc}", fix="see the key named above") from None
    return obj


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(path: str | Path) -> RunConfig:
    """Reload a resolved ``config.yaml`` written by a run (checkpoints, exports, requeued jobs)."""
    schema = OmegaConf.structured(RunConfig)
    try:
        loaded = OmegaConf.load(str(path))
        return OmegaConf.to_object(OmegaConf.merge(schema, loaded))
    except FileNotFoundError:
        raise RecipeError(f"config file '{path}' does not exist", fix="point at a run's config.yaml") from None
    except Exception as exc:
        raise RecipeError(f"config file '{path}' is not a valid recipe: {exc}", fix="regenerate it") from None


def _missing_keys(cfg: DictConfig, prefix: str = "") -> Iterable[str]:
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(cfg, key):
            yield full
            continue
        value = cfg._get_node(key)
        if isinstance(value, DictConfig):
            yield from _missing_keys(value, prefix=f"{full}.")


def _check_override_syntax(overrides: Sequence[str]) -> None:
    for ov in overrides:
        if ov.startswith("hydra."):
            continue
        if "=" not in ov:
            raise RecipeError(
                f"argument '{ov}' is not an override",
                fix="overrides are key=value (e.g. parallel.tp=4) or group=option (e.g. cluster=h100_8gpu)",
            )


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


def _group_option_hint(message: str) -> str:
    for group in ("model", "parallel", "cluster", "precision", "data", "optimizer", "checkpoint", "logging"):
        if f"'{group}" in message or f"{group}/" in message or f"group {group}" in message:
            return f"available {group} options: {', '.join(list_group_options(group))}"
    return "check the option name against the folders under recipes/"


def _describe_compose_error(exc: Exception) -> str:
    text = str(exc).strip()
    if exc.__cause__ is not None:  # Hydra wraps the OmegaConf error that names the key and type
        text += ": " + str(exc.__cause__).strip()
    keep = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("reference_type", "object_type"))]
    return " ".join(keep)


def _fix_for_compose_error(exc: Exception) -> str:
    text = str(exc) + str(exc.__cause__ or "")
    if "not in" in text or "Could not override" in text or "Key '" in text:
        return "check the key spelling; `megatron-recipes plan <recipe> --show-config` prints every valid key"
    if "Value '" in text or "could not be converted" in text or "ValidationError" in type(exc).__name__:
        return "give a value of the type the schema expects (see megatron_recipes/config/schema.py)"
    return "see the message above"
