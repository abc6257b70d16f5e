"""Test-only fault injection: a deliberately broken parallel layout, for the check's failure test.

On PYTHONPATH only in that test (``MR_TEST_FAULT`` names the fault). ``pp_split`` makes every pipeline stage
build the layers of the mirror stage (stage 0 holds the last layers, the last stage the first ones): a
permutation, so checkpoints still save, but the model runs its layers in the wrong order, as a wrong
pipeline split would. Patched right after megatron-core's module is imported, in every process.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGETS = ("megatron.core.transformer.transformer_layer", "megatron.core.transformer.transformer_block")


def _mirror_stage(original):
    def offset(config, vp_stage=None, pp_rank=None):
        from megatron.core import parallel_state

        pp = config.pipeline_model_parallel_size
        if pp <= 1:
            return original(config, vp_stage=vp_stage, pp_rank=pp_rank)
        rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
        return original(config, vp_stage=vp_stage, pp_rank=pp - 1 - rank)

    return offset


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if module.__name__ == TARGETS[0]:
            module.get_transformer_layer_offset = _mirror_stage(module.get_transformer_layer_offset)
        else:
            from megatron.core.transformer import transformer_layer

            module.get_transformer_layer_offset = transformer_layer.get_transformer_layer_offset


if os.environ.get("MR_TEST_FAULT") == "pp_split":
    sys.meta_path.insert(0, _Patcher())
