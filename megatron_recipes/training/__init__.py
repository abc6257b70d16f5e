"""Training on megatron-core: the loop, optimizer/scheduler setup, loss, metrics and log sinks.

Import the submodules directly (``megatron_recipes.training.loop`` ...): this package imports nothing
heavy on its own, so the CLI can parse arguments and spawn ranks before torch is loaded.
"""
