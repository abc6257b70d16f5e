"""``megatron-recipes eval``: what a checkpoint scores, at the layout it was trained in or another one.

- ``options``  the command's ``key=value`` options, checked before any rank starts (no torch)
- ``heldout``  held-out loss and perplexity on the run's own validation split, as the trainer computes them
- ``answers``  a fine-tuning run's validation answers generated (greedy, megatron-core's engine) and scored
- ``cli``      the command: parse, start the ranks (as ``generate`` does), print and keep what rank 0 returns
"""
