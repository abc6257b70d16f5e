"""Recipe -> megatron-core ``GPTModel`` chunks for this rank (layer specs, pipeline stages, VPP chunks)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.models import capabilities
from megatron_recipes.runtime import patches
from megatron_recipes.models.transformer_config import build_transformer_config


def transformer_config_for(cfg: RunConfig):
    """The config this machine trains with: TE spec and fused kernels where available (models.fusions)."""
    from megatron_recipes.models import fusions

    use_te = capabilities.use_transformer_engine()
    decided = fusions.decide(cfg, capabilities.kernels())
    return build_transformer_config(cfg, use_te=use_te, cpu_init=not torch.cuda.is_available(), fusions=decided)


def layer_spec(
    cfg: RunConfig, config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None, use_te: Optional[bool] = None
):
    """The TE spec when TE imports on a GPU, megatron-core's local spec otherwise (or as ``use_te`` says)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = capabilities.use_transformer_engine() if use_te is None else use_te
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=cfg.model.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )
    return _adapted(spec, config, use_te)


def _adapted(spec, config, use_te: bool):
    if not use_te:
        _use_te_checkpoint_names(spec)
        from megatron_recipes.models.local_spec import adapt_local_spec

        spec = adapt_local_spec(spec, config)  # SDPA core attention; SP-capable torch norms
    return spec


def _use_te_checkpoint_names(block_spec) -> None:
    """Give the local spec's checkpoint keys the Transformer Engine spec's names (and let MLA run on it).

    megatron-core's local spec renames the norms TE fuses into linears for dense GPT layers only; for
    MoE layers (TE keeps ``pre_mlp_layernorm``) and MLA (TE fuses the q/kv norms into the up-projections)
    its names differ, so a checkpoint written on the CPU lane would not load on a GPU, or vice versa.
    """

    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_recipes.models.local_mla import use_local_mla_attention
    from megatron_recipes.runtime.mcore_compat import built_class

    def renamed(spec):
        use_local_mla_attention(spec)
        sub = spec.submodules
        if not hasattr(sub, "sharded_state_dict_keys_map"):
            return spec
        attention, mlp = built_class(sub.self_attention), built_class(sub.mlp)  # a ModuleSpec, or a partial (0.18 on)
        keys = {}
        if isinstance(attention, type) and issubclass(attention, MLASelfAttention):
            keys["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
            keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
        else:
            keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
        if not (isinstance(mlp, type) and issubclass(mlp, MoELayer)):
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        return dataclasses.replace(spec, submodules=dataclasses.replace(sub, sharded_state_dict_keys_map=keys))

    block_spec.layer_specs = [renamed(s) for s in block_spec.layer_specs]


def _mtp_spec(cfg: RunConfig, config, block_spec, vp_stage: Optional[int], use_te: bool):
    if not cfg.model.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    layers = block_spec.layer_specs
    if not layers:  # a chunk holding MTP but no decoder layer (a pipeline layout's "m" stage): as Megatron-LM does,
        # the MTP layer is built like the model's last decoder layer
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te, normalization=cfg.model.normalization)[-1]
        layers = _adapted(dataclasses.replace(block_spec, layer_specs=[last]), config, use_te).layer_specs
    spec = get_gpt_mtp_block_spec(config, layers[-1], use_transformer_engine=use_te, vp_stage=vp_stage)
    if spec is not None and not use_te:  # the MTP block's own norms need the same SP-capable swap as the decoder's
        from megatron_recipes.models.local_spec import adapt_local_spec

        spec = adapt_local_spec(spec, config)
    return spec


def build_gpt_model(
    cfg: RunConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    use_te: Optional[bool] = None,
):
    """One GPTModel chunk. Requires megatron-core's parallel_state to be initialised.

    ``use_te=False`` forces the local spec (conversion builds shape-only models from it on any machine;
    its checkpoint keys equal the TE spec's, see ``_use_te_checkpoint_names``).
    """
    from megatron.core.models.gpt import GPTModel

    use_te = capabilities.use_transformer_engine() if use_te is None else use_te
    if not capabilities.detect().transformer_engine:
        # megatron-core's fallbacks without TE (MoE router GEMM, Megatron-FSDP's TELinear check) fail on a
        # GPU image without TE as on the CPU lane: runtime/patches/ scope no_te
        patches.apply("no_te")
    patches.apply("model")  # megatron-core defects in what the model runs, GPU or CPU (the MoE aux-loss scale)
    config = config or transformer_config_for(cfg)
    m = cfg.model
    spec = layer_spec(cfg, config, vp_stage=vp_stage, use_te=use_te)
    rope = m.position_embedding_type
    if m.multi_latent_attention and m.rope_scaling is not None and m.rope_scaling.rope_type == "yarn":
        rope = "rope"  # MLA applies yarn inside its attention module from the MLA config
    scaling = m.rope_scaling if (m.rope_scaling is not None and m.rope_scaling.rope_type == "llama3") else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=derived.padded_vocab_size(m, cfg.parallel.tp),
        max_sequence_length=max(m.max_position_embeddings, cfg.train.seq_length),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type=rope,
        rotary_percent=m.rotary_percent,
        rotary_base=int(m.rotary_base),
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling.factor if scaling is not None else 8.0,
        mtp_block_spec=_mtp_spec(cfg, config, spec, vp_stage, use_te),
        vp_stage=vp_stage,
    )
    if post_process:
        mask_padded_vocab(model.output_layer, m.vocab_size)
    return model


def mask_padded_vocab(output_layer: torch.nn.Module, vocab_size: int) -> None:
    """Logits of the rows megatron-core pads the vocabulary with are set to the dtype's minimum.

    Those rows are not tokens: left at zero (as after an HF import) they would still take softmax mass,
    so our loss would differ from the HF model's on the same weights, and after pretraining they would
    have been trained against. Masking them makes the loss, the gradients and any sampling see exactly
    the real vocabulary; their weights get no gradient. Works on this rank's vocabulary shard, and on the
    whole vocabulary when megatron-core gathers the logits inside the layer (inference: ``runtime_gather_output``).
    """
    from megatron.core import parallel_state

    def hook(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        shard = logits.shape[-1]
        gathered = shard != module.output_size_per_partition  # every rank holds the full padded vocabulary
        start = vocab_size - (0 if gathered else parallel_state.get_tensor_model_parallel_rank() * shard)
        if start < shard:
            logits[..., max(start, 0):] = torch.finfo(logits.dtype).min
        return output

    output_layer.register_forward_hook(hook)


def build_model_chunks(cfg: RunConfig) -> List[torch.nn.Module]:
    """All model chunks this rank holds: one, or ``vpp`` chunks under the interleaved schedule."""
    from megatron.core import parallel_state

    config = transformer_config_for(cfg)
    vpp = cfg.parallel.vpp or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if cfg.parallel.vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunks.append(build_gpt_model(cfg, pre_process=pre, post_process=post, vp_stage=stage, config=config))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for chunk in chunks:
        chunk.to(device)
    return chunks
