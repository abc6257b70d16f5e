"""``megatron-recipes check``: prove a recipe's parallel layout on CPU ranks (shrunk model, one seed, per-step comparison)."""
