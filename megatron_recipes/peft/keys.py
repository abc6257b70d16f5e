"""State-dict keys of wrapper modules: a wrapped base keeps the keys it had before wrapping.

Wrappers hold the base as a child named ``base``; saving writes the base's entries under the wrapper's
own prefix, and a load pre-hook maps them back, so checkpoints and weight loaders see one key set
whether or not a layer is wrapped.
"""

from __future__ import annotations

from typing import Tuple

import torch


def keep_child_keys(wrapper: torch.nn.Module, child: str = "base", own: Tuple[str, ...] = ()) -> None:
    """Register the load-side mapping: ``<prefix>x`` -> ``<prefix><child>.x`` for keys not in ``own``."""

    def hook(state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix) :]
            if rest.startswith(f"{child}.") or any(rest.startswith(o) for o in own):
                continue
            state_dict[f"{prefix}{child}.{rest}"] = state_dict.pop(key)

    wrapper._register_load_state_dict_pre_hook(hook)
