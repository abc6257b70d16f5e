"""Parameter-efficient fine-tuning on megatron-core: LoRA/DoRA, QLoRA (NF4 base), P-Tuning v2.

The trainer calls ``apply_peft(model_chunks, cfg)`` after the checkpoint package has loaded the base
(``checkpoint.pretrained``) and before megatron-core's DDP wrap; adapter modules subclass
``checkpoint.AdapterModule``, so checkpoints hold the adapters only. One module per method, plus what they share:

* ``apply``: ``apply_peft`` (freeze, check, attach) and the whole-model parameter counts it reports;
* ``lora``: LoRA/DoRA around megatron-core's tensor-parallel linears, and merging them into the base;
* ``qlora`` + ``nf4``: QLoRA's frozen NF4 base linear, and the NF4 numerics (double-quantised scales);
* ``ptuning``: P-Tuning v2 key/value prefixes in every attention layer;
* ``linears``: what adapters share about the base linears (split, targets, state-dict keys, layout-free init);
* ``state``: preparing a model for PEFT training (applying adapters to the loaded base).

Which ``peft.method`` strings exist and combine is decided in ``config/peft_methods.py``; the HF export of a
PEFT run (merged weights or an HF PEFT adapter directory) is ``convert/peft_export.py``.
"""

from megatron_recipes.peft.apply import PeftSummary, apply_peft

__all__ = ["PeftSummary", "apply_peft"]
