"""``python -m megatron_recipes.generate`` / ``torchrun -m megatron_recipes.generate``: one rank's entry.

``generate`` starts its local ranks through torchrun with this module (as ``train`` does with
``megatron_recipes.train``); each rank runs the same command line.
"""

from __future__ import annotations

import sys


def main() -> int:
    from megatron_recipes.runtime import patches

    patches.apply("process")
    from megatron_recipes.cli import main as cli_main

    return cli_main(["generate", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
