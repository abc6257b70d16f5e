"""``python -m megatron_recipes.train`` and ``torchrun -m megatron_recipes.train``: one rank's entry.

Applies the ``process`` patches (runtime/patches/) before megatron-core is imported. The checkpoint
writer no longer starts megatron-core's ``spawn`` manager (the ``save`` patch), so nothing re-imports
this module; the ``__main__`` guard is only the usual one.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.runtime import patches

    from megatron_recipes.runtime.known_warnings import quiet

    quiet()  # the known third-party warnings, hidden and counted in the launching command's tally
    try:
        patches.apply("process")  # refuses a megatron-core outside the supported range
        from megatron_recipes.training.cli import main as train_main

        return int(train_main(list(sys.argv[1:] if argv is None else argv)) or 0)
    except RecipeError as exc:
        from megatron_recipes.runtime.rank_errors import report

        report(exc.render())  # the local launcher prints it once for all ranks
        return 2


if __name__ == "__main__":
    sys.exit(main())
