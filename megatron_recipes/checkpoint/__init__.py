"""Checkpoints (placeholder; the public API follows in the next commit)."""
