"""The megatron-core releases this project supports, and every difference between them it must know about.

Why one module: 0.16.1 to 0.19.2 renamed private helpers, moved the common checkpoint state into the
``.distcp`` files and started building layers from ``functools.partial`` specs. Each such difference is
named here once, with the release that introduced it, so callers ask a question ("does this release
write common.pt?") instead of guessing with ``try/except AttributeError`` (read from each release's
source: 0.16.1, 0.17.1, 0.18.2, 0.19.2). The patch table (``patches/``) records its own ranges.
"""

from __future__ import annotations

import functools
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Dict, Optional, Tuple

from megatron_recipes.config.errors import RecipeError

# Supported: [first, first unsupported). pyproject.toml's pin must say the same (tests/test_mcore_compat.py).
SUPPORTED = ("0.16", "0.20")
NEWEST_TESTED = "0.19.2"  # the gpu extra and the Dockerfile install exactly this one
# megatron-core 0.17 and later declare Requires-Python >= 3.12: on Python 3.11 pip finds 0.16.x only.

COMMON_STATE_FILE = "common.pt"
COMMON_STATE_IN_DISTCP_SINCE = "0.19"  # save() stores the common state as a ShardedObject, no common.pt


def version_tuple(text: str) -> Tuple[int, ...]:
    """``"0.19.2"`` -> ``(0, 19, 2)``; a pre-release or local suffix (``rc1``, ``+cu13``) is ignored."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", text).group(0))[:3])


def installed() -> str:
    """The installed megatron-core's version, or ``"absent"``."""
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "absent"


def at_least(first: str, release: Optional[str] = None) -> bool:
    return version_tuple(release or installed()) >= version_tuple(first)


def in_range(low: str, high: Optional[str], release: Optional[str] = None) -> bool:
    """``low <= release < high`` (``high`` None: no upper end)."""
    now = version_tuple(release or installed())
    return now >= version_tuple(low) and (high is None or now < version_tuple(high))


def pip_requirement() -> str:
    return f"megatron-core>={SUPPORTED[0]},<{SUPPORTED[1]}"


def require_supported(release: Optional[str] = None) -> None:
    """Refuse a megatron-core outside ``SUPPORTED``: its behaviour is unknown, and a failure deep inside it
    would read like a bug of the recipe."""
    found = release or installed()
    if found == "absent":
        raise RecipeError(
            "megatron-core is not installed",
            fix=f"pip install '{pip_requirement()}' (or pip install 'megatron-recipes[gpu]' for megatron-core {NEWEST_TESTED} with Transformer Engine)",
        )
    if not in_range(*SUPPORTED, release=found):
        raise RecipeError(
            f"megatron-core {found} is installed; megatron-recipes supports megatron-core {SUPPORTED[0]} up to "
            f"(not including) {SUPPORTED[1]}",
            fix=f"pip install '{pip_requirement()}' (newest tested: megatron-core=={NEWEST_TESTED}, which needs "
            "Python 3.12; on Python 3.11 pip picks 0.16.x)",
        )


# --- checkpoints ---


def writes_common_pt(release: Optional[str] = None) -> bool:
    """Whether ``dist_checkpointing.save`` of this release writes ``common.pt`` (0.16-0.18) or keeps the
    common state inside the ``.distcp`` files (0.19 on)."""
    return not at_least(COMMON_STATE_IN_DISTCP_SINCE, release)


def reads_common_state_from_distcp(release: Optional[str] = None) -> bool:
    """0.19's ``load_common_state_dict`` reads both layouts; older releases read ``common.pt`` only."""
    return at_least(COMMON_STATE_IN_DISTCP_SINCE, release)


def write_results_queue_getter() -> Callable[[], Any]:
    """The checkpoint writer's results-queue factory: ``_get_write_results_queue`` until 0.16,
    ``get_write_results_queue(mp_mode='spawn')`` from 0.17."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    name = "get_write_results_queue" if at_least("0.17") else "_get_write_results_queue"
    return getattr(filesystem_async, name)


def async_save_options(release: Optional[str] = None) -> Dict[str, Any]:
    """Extra ``dist_checkpointing.save`` arguments of an async save: from 0.17 it takes ``async_strategy``,
    whose default ``"nvrx"`` needs nvidia-resiliency-ext; ``"mcore"`` is megatron-core's own writer, the one
    0.16 always used, whose ``AsyncCallsQueue`` (``strategies.async_utils``) the trainer drives."""
    return {"async_strategy": "mcore"} if at_least("0.17", release) else {}


# --- layer specs ---


def built_class(node: Any) -> Optional[type]:
    """The class a layer-spec entry builds: a class itself, a ``ModuleSpec``'s module, or the function a
    ``functools.partial`` wraps (0.18 on, MoE layers and shared experts), looked through recursively."""
    while True:
        if isinstance(node, type):
            return node
        if isinstance(node, functools.partial):
            node = node.func
            continue
        module = getattr(node, "module", None)
        if module is None or module is node:
            return None
        node = module
