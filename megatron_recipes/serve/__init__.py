"""``megatron-recipes serve``: an OpenAI-compatible HTTP endpoint on a checkpoint, through megatron-core's
inference engine at the checkpoint's layout (or another one).

- ``protocol`` the request bodies as OpenAI's API defines them, checked into one ``Request`` (no torch)
- ``batcher``  rank 0 gathers waiting requests into engine batches; every rank runs each batch
- ``app``      the FastAPI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)
- ``cli``      the command: options, the ranks (as ``generate`` starts them), uvicorn on rank 0
"""
