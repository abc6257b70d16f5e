"""Declarative HF <-> Megatron mappings, one small file per model family."""
