"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` on the CPU lane (a test tool, never part of the package).

Why: the proof that our checkpoints load in Megatron-LM, and the Megatron-LM fixture in tests/data, must come
from Megatron-LM's code, not from a re-creation of it. Its training script assumes a GPU in a few places
that have nothing to do with checkpoints; each is neutralised here and nowhere else:
- ``initialize_megatron`` asserts ``torch.cuda.is_available()``: answered yes, the lane maps every CUDA call
  to the CPU (``megatron_recipes.runtime.cpu_lane``);
- it builds CUDA kernels (fused kernels, the dataset helpers ``make``, the JIT warm-up): skipped, every fusion
  is off on the command line and the installed megatron-core ships its dataset helpers built;
- its batch-invariant kernels import triton at import time: a stand-in module with their two switches;
- megatron-core's plain-torch optimizer path (no Apex, no TE) cannot load a checkpoint into a fresh
  optimizer: the same rows of ``runtime/patches`` our trainer applies go onto Megatron-LM's optimizer;
- a synchronous torch_dist save starts a spawned Manager that re-runs this script: an in-process queue
  (the same remedy as our own saves, ``checkpoint/_mcore.py``).

Usage: ``MEGATRON_LM_DIR=<checkout> torchrun --nproc_per_node N tests/megatron_lm_shim.py <pretrain_gpt.py args>``
"""

import os
import queue
import runpy
import sys
import types

from megatron_recipes.runtime import cpu_lane

cpu_lane.activate()
_kernels = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
_kernels.enable_batch_invariant_mode = lambda *a, **k: None
_kernels.is_batch_invariant_mode_enabled = lambda *a, **k: False
sys.modules[_kernels.__name__] = _kernels

import torch  # noqa: E402

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *a, **k: None

CHECKOUT = os.environ["MEGATRON_LM_DIR"]
sys.path.insert(0, CHECKOUT)

import megatron.core.datasets.utils as _dataset_utils  # noqa: E402
import megatron.core.dist_checkpointing.strategies.filesystem_async as _filesystem_async  # noqa: E402
import megatron.legacy.fused_kernels as _fused_kernels  # noqa: E402
import megatron.training.training as _training  # noqa: E402

_dataset_utils.compile_helpers = lambda: None
_fused_kernels.load = lambda args: None
_training.set_jit_fusion_options = lambda *a, **k: None
_filesystem_async._results_queue = queue.Queue()
_build_optimizer = _training.get_megatron_optimizer


def _optimizer_on_the_lane(*args, **kwargs):
    from megatron_recipes.runtime import patches

    optimizer = _build_optimizer(*args, **kwargs)
    patches.apply("optimizer", optimizer)
    return optimizer


_training.get_megatron_optimizer = _optimizer_on_the_lane

if __name__ == "__main__":
    sys.argv = [os.path.join(CHECKOUT, "pretrain_gpt.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
