"""HF <-> Megatron checkpoint conversion: streaming I/O, the mapping engine, and logits verification.

The per-family mappings (and the vocabulary they are written in) live in ``megatron_recipes.families``;
this package is the engine that applies them, and the export of PEFT runs (``peft_export``).
"""
