"""The trainer's rank entry, except that one rank SIGKILLs itself in the middle of one checkpoint save.

Used by the crash tests: ``torchrun ... tests/helpers/kill_during_save.py <recipe> [overrides]`` with
``KILL_AT_STEP`` (the save to interrupt) and ``KILL_RANK``. The kill happens after that rank's shards
of megatron-core's save are on disk but before the checkpoint is marked complete, which is the moment a
careless writer would leave a folder that looks usable.
"""

import os
import signal
import sys
from pathlib import Path


def _install() -> None:
    import torch

    from megatron_recipes.checkpoint import _mcore as checkpoint_io

    kill_step, kill_rank = int(os.environ["KILL_AT_STEP"]), int(os.environ.get("KILL_RANK", "0"))
    original = checkpoint_io.save

    def save(sharded_sd, directory, content_metadata):
        original(sharded_sd, directory, content_metadata)
        if Path(directory).name.startswith(f"iter_{kill_step:07d}") and torch.distributed.get_rank() == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_io.save = save


if __name__ == "__main__":
    _install()
    from megatron_recipes.train import main

    sys.exit(main())
