"""Parameter-efficient fine-tuning on megatron-core: LoRA/DoRA, QLoRA (NF4 base), P-Tuning v2.

The trainer calls ``apply_peft(model_chunks, cfg)`` after the checkpoint package has loaded the base
(``checkpoint.pretrained``) and before megatron-core's DDP wrap; adapter modules subclass
``checkpoint.AdapterModule``, so checkpoints hold the adapters only. ``peft.merge`` folds adapters into
the base for export, ``peft.export`` writes an HF PEFT adapter directory.
"""

from megatron_recipes.peft.apply import PeftSummary, apply_peft

__all__ = ["PeftSummary", "apply_peft"]
