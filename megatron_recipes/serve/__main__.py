"""``torchrun -m megatron_recipes.serve``: one rank's entry (``serve`` starts its local ranks with it)."""

from __future__ import annotations

import sys


def main() -> int:
    from megatron_recipes.runtime import patches

    patches.apply("process")
    from megatron_recipes.cli import main as cli_main

    return cli_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
