"""LoRA and DoRA adapters around megatron-core's tensor-parallel linears, and merging them into the base.

Split (so no activation-sized communication is added to the base layer's own):

* column-parallel base ``W_p [out/tp, in]``: ``A [r, in]`` replicated, ``B_p [out/tp, r]`` sharded like
  ``W``. The adapter output lands in the base's sharded output. Under sequence parallelism ``x A^T`` is
  computed on the local sequence shard and gathered (``r`` wide instead of ``in`` wide).
* row-parallel base ``W_p [out, in/tp]``: ``A_p [r, in/tp]`` sharded like ``W``, ``B [out, r]``
  replicated. With megatron-core's local linears (and the NF4 base) the adapter's partial output is added
  to the base's partial output *before* the base's own all-reduce / reduce-scatter, so the forward adds
  no communication at all. Transformer Engine reduces inside its kernel, so there ``x A_p^T`` (``r``
  wide) is reduced separately.

Replicated adapter weights whose gradient is a partial sum per rank get it summed over the TP group
inside autograd (megatron-core's ``copy_to_tensor_model_parallel_region`` applied to the weight:
identity forward, all-reduce backward), so every replica stays identical without relying on DDP.

DoRA (Liu et al. 2024, as in HF PEFT): ``y = base(x) + (g - 1) * (x W^T) + g * s * B A x`` with
``g = m / ||W + s B A||_row`` and the norm detached; for a row-parallel base the row norm over the full
input dimension is an all-reduce of a vector of ``out`` squared sums.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_recipes.checkpoint import AdapterModule
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.peft.linears import LinearLayout, keep_child_keys, layout_of, make_param, sharded, uniform
from megatron_recipes.peft.ptuning import PrefixCoreAttention
from megatron_recipes.peft.qlora import NF4ParallelLinear
from megatron_recipes.runtime import collectives


def _group_rank(group) -> int:
    return group.rank() if group is not None else 0


class LoRALinear(torch.nn.Module, AdapterModule):
    """A frozen base linear plus a trainable low-rank update (and DoRA magnitude)."""

    def __init__(
        self,
        base: torch.nn.Module,
        name: str,
        rank: int,
        alpha: float,
        dropout: float,
        dora: bool,
        seed: int,
        gated_fc1: bool = False,
    ):
        super().__init__()
        self.base = base
        self.layout: LinearLayout = layout_of(base)
        self.name, self.rank, self.alpha, self.dora, self.gated_fc1 = name, rank, alpha, dora, gated_fc1
        self.scaling = alpha / rank
        self.dropout_p = dropout
        lay = self.layout
        weight_dtype = self._dense_weight().dtype if not isinstance(base, NF4ParallelLinear) else base.dense_dtype
        device = self._device()
        tp_rank = _group_rank(lay.tp_group)
        allreduce = base.weight_allreduce if isinstance(base, NF4ParallelLinear) else bool(getattr(base.weight, "allreduce", True))
        a_dim, b_dim = (None, 0) if lay.kind == "column" else (1, None)
        a = sharded(uniform(1.0 / math.sqrt(lay.in_full)), (rank, lay.in_full), seed, f"{name}.lora_a", a_dim, tp_rank, lay.tp_size)
        b = torch.zeros(lay.out_local, rank)
        self.lora_a = make_param(a, weight_dtype, device, a_dim, allreduce)
        self.lora_b = make_param(b, weight_dtype, device, b_dim, allreduce)
        if dora:
            magnitude = self._weight_norm(with_update=False)
            self.magnitude = make_param(magnitude, weight_dtype, device, b_dim, allreduce)
        else:
            self.register_parameter("magnitude", None)
        if lay.engine == "local" and lay.kind == "row":
            self._install_pre_reduction_hook()
        if lay.engine == "te" and lay.fused_norm:
            base.return_layernorm_output = True
            base.return_layernorm_output_gathered = False
        keep_child_keys(self, "base", own=("lora_a", "lora_b", "magnitude"))

    # -- helpers ---------------------------------------------------------------------------------------
    def _dense_weight(self) -> torch.Tensor:
        if isinstance(self.base, NF4ParallelLinear):
            return self.base.dequantized(torch.float32)
        return self.base.weight

    def _device(self) -> torch.device:
        if isinstance(self.base, NF4ParallelLinear):
            return self.base.qweight.device
        return self.base.weight.device

    def _tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Identity forward, gradient summed over the layer's TP group backward."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        if self.layout.tp_size == 1:
            return tensor
        return copy_to_tensor_model_parallel_region(tensor, group=self.layout.tp_group)

    def _dropout(self, x: torch.Tensor, sharded_input: bool) -> torch.Tensor:
        """Replicated inputs draw from the default generator (same mask on every TP rank), sharded ones
        from megatron-core's model-parallel RNG stream, as megatron-core does for its own dropouts."""
        if self.dropout_p == 0.0 or not self.training:
            return x
        if sharded_input and self.layout.tp_size > 1:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout_p, True)
        return F.dropout(x, self.dropout_p, True)

    @torch.no_grad()
    def _weight_norm(self, with_update: bool = True) -> torch.Tensor:
        """``||W + s B A||`` per output row over the full input dimension (fp32, no gradient)."""
        w = self._dense_weight().float()
        if with_update:
            w = w + self.scaling * (self.lora_b.float() @ self.lora_a.float())
        sq = w.pow(2).sum(dim=1)
        lay = self.layout
        if lay.kind == "row" and lay.tp_size > 1:
            collectives.all_reduce(sq, group=lay.tp_group)
        return sq.sqrt()

    def _gain(self, partial: bool) -> Optional[torch.Tensor]:
        """DoRA's ``m / ||W + sBA||``; ``partial``: the caller multiplies per-rank partial sums."""
        if not self.dora:
            return None
        norm = self._weight_norm().to(self.magnitude.dtype)
        magnitude = self._tp(self.magnitude) if partial else self.magnitude
        return magnitude / norm

    @staticmethod
    def _combine(lora: torch.Tensor, base_out: torch.Tensor, gain: Optional[torch.Tensor]) -> torch.Tensor:
        if gain is None:
            return lora
        return (gain - 1.0) * base_out + gain * lora

    # -- the three placements of the update -------------------------------------------------------------
    def _column_delta(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        lay = self.layout
        xd = self._dropout(x, sharded_input=lay.sequence_parallel)
        if not lay.communicates:  # expert: tokens replicated over the group; the dispatcher reduces dx
            h = F.linear(xd, self._tp(self.lora_a))
        elif lay.sequence_parallel:
            h = F.linear(xd, self._tp(self.lora_a))
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=lay.tp_group)
        else:
            h = F.linear(xd, self.lora_a)
            if lay.tp_size > 1:
                h = copy_to_tensor_model_parallel_region(h, group=lay.tp_group)
        lora = F.linear(h, self.lora_b) * self.scaling
        return self._combine(lora, base_out, self._gain(partial=False))

    def _row_partial(self, x: torch.Tensor, base_partial: torch.Tensor) -> torch.Tensor:
        """Added to the base's partial output before its reduction (no extra forward communication)."""
        xd = self._dropout(x, sharded_input=True)
        lora = F.linear(F.linear(xd, self.lora_a), self._tp(self.lora_b)) * self.scaling
        return self._combine(lora, base_partial, self._gain(partial=True))

    def _row_post_delta(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        """Transformer Engine row layers reduce inside the kernel: reduce the r-wide ``x A_p^T`` here."""
        from megatron.core.tensor_parallel import (
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        lay = self.layout
        h = F.linear(self._dropout(x, sharded_input=True), self.lora_a)
        if lay.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=lay.tp_group)
            b, partial = self._tp(self.lora_b), True
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=lay.tp_group)
            b, partial = self.lora_b, False
        lora = F.linear(h, b) * self.scaling
        return self._combine(lora, base_out, self._gain(partial=partial))

    def _install_pre_reduction_hook(self) -> None:
        """megatron-core's RowParallelLinear computes its partial product in ``_forward_impl`` and reduces
        right after; an instance-level wrapper of that one method adds the adapter's partial in between."""
        original = self.base._forward_impl
        wrapper = self

        def forward_impl(input, weight, *args, **kwargs):
            out = original(input, weight, *args, **kwargs)
            return out + wrapper._row_partial(input, out)

        self.base._forward_impl = forward_impl

    def remove_hooks(self) -> None:
        if "_forward_impl" in self.base.__dict__:
            del self.base.__dict__["_forward_impl"]
        if self.layout.engine == "te" and self.layout.fused_norm:
            self.base.return_layernorm_output = False

    # -- forward -----------------------------------------------------------------------------------------
    def _without_bias(self, out: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The base's ``x W^T`` (DoRA rescales it, not the bias)."""
        if not self.dora or self.layout.skip_bias_add:
            return out
        own_bias = getattr(self.base, "bias", None)
        if own_bias is None or own_bias.numel() == 0:
            return out
        return out - own_bias

    def forward(self, x: torch.Tensor, *args, **kwargs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        lay = self.layout
        if lay.engine == "nf4":
            if lay.kind == "row":
                return self.base(x, partial_fn=self._row_partial)
            out, bias, seen = self.base(x, return_input=True)
            return out + self._column_delta(seen, self._without_bias(out, bias)), bias
        if lay.kind == "row" and lay.engine == "local":
            return self.base(x, *args, **kwargs)  # the update joins inside, before the reduction
        if lay.engine == "te" and lay.fused_norm:
            out, bias, seen = _split_te_layernorm_output(self.base(x, *args, **kwargs))
        else:
            out, bias = self.base(x, *args, **kwargs)
            seen = x
        if lay.kind == "column":
            return out + self._column_delta(seen, self._without_bias(out, bias)), bias
        return out + self._row_post_delta(seen, self._without_bias(out, bias)), bias

    # -- merge -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of the base weight with the update folded in (fp32)."""
        w = self._dense_weight().float() + self.scaling * (self.lora_b.float() @ self.lora_a.float())
        if self.dora:
            gain = self.magnitude.float() / self._weight_norm()
            w = gain.unsqueeze(1) * w
        return w

    # -- state dicts --------------------------------------------------------------------------------------
    def adapter_params(self):
        out = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        if self.dora:
            out["magnitude"] = self.magnitude
        return out

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The base's entries under the base's own keys, then ``lora_a``/``lora_b``/``magnitude``."""
        destination = self.base.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self._save_to_state_dict(destination, prefix, keep_vars)
        return destination

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(self.adapter_sharded_state_dict(prefix, sharded_offsets, metadata))
        return out

    def adapter_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Adapter tensors only, split like the base (fc1 of a gated MLP: gate and up halves apart)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        dp_cp_group = metadata.get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        axis = {"lora_b": 0, "magnitude": 0} if self.layout.kind == "column" else {"lora_a": 1}
        params = {k: v for k, v in self.adapter_params().items()}
        sd = make_sharded_tensors_for_checkpoint(
            params, prefix, axis, sharded_offsets, tp_group=self.layout.tp_group, dp_cp_group=dp_cp_group
        )
        if self.gated_fc1:
            single = metadata.get("singleton_local_shards", False)
            for key in (f"{prefix}lora_b", f"{prefix}magnitude"):
                if key in sd:
                    sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets, single)
        return sd

    def backward_dw(self) -> None:
        if hasattr(self.base, "backward_dw"):
            self.base.backward_dw()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def extra_repr(self) -> str:
        kind = "DoRA" if self.dora else "LoRA"
        return f"{kind}(rank={self.rank}, alpha={self.alpha}, {self.layout.kind}, tp={self.layout.tp_size})"


def _split_te_layernorm_output(result):
    """TE LayerNormLinear with ``return_layernorm_output``: ``((out, ln), None)`` or ``(out, bias, ln)``."""
    if len(result) == 3:
        return result
    first, bias = result
    out, ln_out = first
    return out, bias, ln_out


# --- merge: fold adapters into the base (for export, or serving as is) -----------------------------
# ``W' = W + s B A`` (LoRA) or ``W' = m / ||W + s B A|| * (W + s B A)`` (DoRA), per rank on its own shard:
# both factors are split like the base, so no communication is needed beyond DoRA's row norm. An NF4 base
# is dequantised first (the merged model is what QLoRA trained: the quantised base plus the update).


def _replace(chunk: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(chunk.get_submodule(parent_path) if parent_path else chunk, attr, module)


@torch.no_grad()
def merge_and_unload(chunks: List[torch.nn.Module]) -> int:
    """Merge every LoRA/DoRA adapter into its base; returns how many modules were merged."""
    merged = 0
    for chunk in chunks:
        wrapped = [(p, m) for p, m in chunk.named_modules() if isinstance(m, (LoRALinear, PrefixCoreAttention))]
        for path, module in wrapped:
            if isinstance(module, PrefixCoreAttention):
                raise RecipeError(
                    "P-Tuning v2 prefixes are extra keys/values, not a weight update: they cannot be merged into the base",
                    fix="export LoRA-family runs only (peft.method lora, dora, qlora)",
                )
            weight = module.merged_weight()
            module.remove_hooks()
            base = module.base
            if isinstance(base, NF4ParallelLinear):
                base = base.to_dense(weight)
            else:
                base.weight.data.copy_(weight.to(base.weight.dtype))
            _replace(chunk, path, base)
            merged += 1
    return merged
