"""``megatron-recipes generate``: text from a checkpoint through megatron-core's own inference engine.

- ``options``  the command's ``key=value`` options, checked, and the prompts they name (no torch)
- (the text side, tokenizer, chat template and stop strings, is ``data/prompts.py``: eval and export use it too)
- ``engine``   one rank's work: the model at a layout, its weights, megatron-core's engine run on token ids
- ``cli``      the command: parse, start the ranks (as ``train`` does), print what rank 0 returns
"""
