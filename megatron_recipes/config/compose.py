"""Recipe name + Hydra overrides -> typed ``RunConfig``.

Composition goes through Hydra's compose API against the ``recipes/`` tree (shipped inside the wheel
as ``megatron_recipes._recipes``), with the schema dataclasses registered in the ConfigStore so unknown
keys and wrong types fail here, before anything starts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import os
import re
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

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
    except AssertionError:  # OmegaConf.update asserts when a key's parent is null (model.rope_scaling.factor)
        raise _override_under_null(recipe, overrides) from None
    except Exception as exc:  # YAML syntax, OmegaConf internals (merging a dict into a null typed group)
        raise _unreadable(recipe, config_dir, exc) from None
    if OmegaConf.get_type(cfg) is not RunConfig:  # an empty file, or a defaults list without run_schema
        raise RecipeError(
            f"recipe '{recipe}' is not a recipe: it is empty or its defaults list does not start with {SCHEMA_NAME}",
            fix=f"begin it with `defaults: [{SCHEMA_NAME}, model: ..., parallel: ..., cluster: ..., precision: ..., "
            "data: ..., optimizer: ..., _self_]` (see recipes/tiny_llama_cpu.yaml)",
        )
    unknown = sorted(_unknown_keys(cfg))
    if unknown:  # `+key=value` adds a key even to a typed group; to_object would then drop it silently
        raise RecipeError(
            f"unknown key(s) {', '.join(unknown)}: not in the schema, so they would be silently ignored",
            fix="check the key spelling (no '+' needed for schema keys); "
            "`megatron-recipes plan <recipe> --show-config` prints every valid key",
        )
    return cfg


def compose_recipe(recipe: str, overrides: Sequence[str] = ()) -> RunConfig:
    """The typed, fully resolved recipe. Missing required values are reported by key.

    Hydra takes ~80 ms of CPU per composition, and a process often composes the same recipe again (plan's
    rows, check's runs, every checkpoint save's comparison): a composition is kept, keyed by the recipe, the
    overrides and the bytes of every file Hydra could read for it, and handed out as a copy."""
    key = _composition_key(recipe, overrides)
    kept = _COMPOSED.get(key) if key is not None else None
    if kept is not None:
        _COMPOSED.move_to_end(key)
        return copy.deepcopy(kept)
    obj = _compose_recipe(recipe, overrides)
    if key is not None:
        _COMPOSED[key] = copy.deepcopy(obj)
        if len(_COMPOSED) > 64:
            _COMPOSED.popitem(last=False)
    return obj


_COMPOSED: "OrderedDict[tuple, RunConfig]" = OrderedDict()


def compositions(last: int = 4) -> list:
    """This process's ``last`` compositions, handed to the ranks it starts (runtime/ranks.py): a rank forked to
    run the recipe its launcher just composed finds it composed. Each entry's key holds the bytes of every file it
    was composed from, so a rank that reads a changed file (or resolves a relative path elsewhere) composes anew."""
    return list(_COMPOSED.items())[-last:]


def adopt(entries: Iterable) -> None:
    """Keep compositions another process made (``compositions()``), as if composed here."""
    for key, obj in entries:
        _COMPOSED[key] = obj
    while len(_COMPOSED) > 64:
        _COMPOSED.popitem(last=False)


def _composition_key(recipe: str, overrides: Sequence[str]) -> Optional[tuple]:
    """What determines a composition: the recipe, the overrides and the content of the YAML files in the
    folders Hydra searches (a group option lies one folder down); None where the result could depend on
    anything else (an interpolation such as ``${oc.env:...}`` or ``${now:...}``, a package search path)."""
    overrides = tuple(overrides)
    if any("${" in o for o in overrides):
        return None
    folders = [recipes_dir()]
    if recipe.endswith((".yaml", ".yml")):
        folders.append(Path(recipe).resolve().parent)
    for item in overrides:
        if item.startswith(("hydra.searchpath=", "+hydra.searchpath=")):
            for entry in item.split("=", 1)[1].strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if not entry.startswith("file://"):
                    return None
                folders.append(Path(entry[len("file://"):]))
    digest = hashlib.sha1()
    for folder in folders:
        for path in sorted([*folder.glob("*.yaml"), *folder.glob("*/*.yaml")]):
            try:
                data = path.read_bytes()
            except OSError:
                return None
            if b"${" in data:
                return None
            digest.update(str(path).encode() + b"\0" + data + b"\0")
    return recipe, overrides, digest.digest()


def _compose_recipe(recipe: str, overrides: Sequence[str]) -> RunConfig:
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


_YAML: "OrderedDict[str, str]" = OrderedDict()  # repr(cfg) -> its YAML, the last few


def to_yaml(cfg: RunConfig) -> str:
    """The recipe as YAML. A run writes the same recipe several times (config.yaml, each checkpoint, the
    trackers), and OmegaConf takes ~80 ms to build it: kept by the recipe's value (its repr covers every
    field), so a changed recipe is written anew."""
    key = repr(cfg)
    text = _YAML.get(key)
    if text is None:
        text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        _YAML[key] = text
        if len(_YAML) > 8:
            _YAML.popitem(last=False)
    return text


def from_yaml(path: str | Path) -> RunConfig:
    """Reload a resolved ``config.yaml`` written by a run (checkpoints, exports, requeued jobs)."""
    schema = OmegaConf.structured(RunConfig)
    try:
        loaded = OmegaConf.load(str(path))
        cfg = OmegaConf.to_object(OmegaConf.merge(schema, loaded))
    except FileNotFoundError:
        raise RecipeError(f"config file '{path}' does not exist", fix="point at a run's config.yaml") from None
    except Exception as exc:
        raise RecipeError(f"config file '{path}' is not a valid recipe: {exc}", fix="regenerate it") from None
    cfg.checkpoint.trust_code = False  # a checkpoint cannot vouch for itself: trust comes from the user only
    return cfg


def _missing_keys(cfg: DictConfig, prefix: str = "") -> Iterable[str]:
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(cfg, key):
            yield full
            continue
        value = cfg._get_node(key)
        if isinstance(value, DictConfig):
            yield from _missing_keys(value, prefix=f"{full}.")


def _unknown_keys(cfg: DictConfig, prefix: str = "") -> Iterable[str]:
    """Keys of typed (dataclass) nodes that their dataclass does not declare."""
    kind = OmegaConf.get_type(cfg)
    declared = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if declared is not None and key not in declared:
            yield full
            continue
        value = cfg._get_node(key)
        if isinstance(value, DictConfig) and not value._is_none() and not value._is_missing():
            yield from _unknown_keys(value, prefix=f"{full}.")


def _override_under_null(recipe: str, overrides: Sequence[str]) -> RecipeError:
    """Name the override whose parent group is null in the recipe (found by composing without it)."""
    keys = [ov.lstrip("+~").split("=", 1)[0] for ov in overrides if not ov.startswith("hydra.")]
    groups_only = [ov for ov in overrides if ov.startswith("hydra.") or "." not in ov.split("=", 1)[0]]
    base = None
    if len(groups_only) < len(overrides):  # else composing them again would fail the same way
        try:
            base = compose_dict(recipe, groups_only)
        except RecipeError:
            pass
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if base is not None and OmegaConf.select(base, parent, default="absent") is None:
                return RecipeError(
                    f"override '{key}' sets a key inside '{parent}', which is null in recipe '{recipe}'",
                    fix=f"set {parent} in a recipe .yaml (its defaults plus the fields you change); "
                    "the command line cannot fill a group the recipe leaves null",
                )
    return RecipeError(f"an override of recipe '{recipe}' sets a key inside a null group", fix="set the whole group")


def _unreadable(recipe: str, config_dir: Path, exc: Exception) -> RecipeError:
    """One message for a recipe or override Hydra could not even compose (no traceback)."""
    import yaml

    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or _first_line(exc)
        name = getattr(mark, "name", None) or recipe
        return RecipeError(f"recipe file '{name}' is not valid YAML{where}: {problem}", fix="fix the YAML syntax there")
    if isinstance(exc, UnicodeDecodeError):
        return RecipeError(f"a recipe file under '{config_dir}' is not UTF-8 text ({exc.reason})",
                           fix="pass a YAML text file as the recipe")
    detail = " ".join(str(exc).split())[:300]
    return RecipeError(f"recipe '{recipe}' with these overrides could not be composed: {type(exc).__name__}: {detail}",
                       fix="check the overrides named above; a group the recipe leaves null must be set in a recipe .yaml")


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


def schema_keys(kind: type = RunConfig, prefix: str = "") -> List[str]:
    """Every dotted key of the recipe schema (dataclass fields, nested groups expanded)."""
    import typing

    hints = typing.get_type_hints(kind)  # the schema's annotations are strings (postponed evaluation)
    out: List[str] = []
    for f in dataclasses.fields(kind):
        inner = hints.get(f.name)
        out += schema_keys(inner, f"{prefix}{f.name}.") if dataclasses.is_dataclass(inner) else [f"{prefix}{f.name}"]
    return out


_UNKNOWN_OVERRIDE = re.compile(r"Could not override '([^']+)'")


def _describe_compose_error(exc: Exception) -> str:
    text = str(exc).strip()
    if exc.__cause__ is not None:  # Hydra wraps the OmegaConf error that names the key and type
        text += ": " + str(exc.__cause__).strip()
    # Hydra's "+key" advice adds a key the typed schema then rejects: never repeat it
    text = re.sub(r"\s*To append to your config use \+\S+", "", text)
    keep = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("reference_type", "object_type"))]
    return " ".join(keep)


def did_you_mean(key: str) -> str:
    """``did you mean a, b?`` for a key close to schema keys (empty when none is close)."""
    keys = schema_keys()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    if not close:  # a typo in the group part: match the leaf within the closest group
        group, _, leaf = key.partition(".")
        groups = difflib.get_close_matches(group, sorted({k.split(".")[0] for k in keys}), n=1)
        if groups and leaf:
            close = difflib.get_close_matches(f"{groups[0]}.{leaf}", keys, n=3, cutoff=0.75)
    return f"did you mean {', '.join(close)}? " if close else ""


def _fix_for_compose_error(exc: Exception) -> str:
    text = str(exc) + str(exc.__cause__ or "")
    if "not in" in text or "Could not override" in text or "Key '" in text:
        found = _UNKNOWN_OVERRIDE.search(text)
        hint = did_you_mean(found.group(1)) if found else ""
        return (f"{hint}check the key spelling; `megatron-recipes plan <recipe> --show-config` prints every valid key")
    if "Value '" in text or "could not be converted" in text or "ValidationError" in type(exc).__name__:
        return "give a value of the type the schema expects (see megatron_recipes/config/schema.py)"
    return "see the message above"
