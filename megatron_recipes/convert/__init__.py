"""HF <-> Megatron checkpoint conversion: streaming I/O, the mapping engine, and logits verification.

The per-family name tables live in the top-level ``conversion/`` folder (package
``megatron_recipes._conversion``); everything they share lives here.
"""
