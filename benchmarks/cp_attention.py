"""CPU-lane step time of the project's core attention against megatron-core's local one, side by side.

    python benchmarks/cp_attention.py [seq ...]            (default: 512 2048)

One process, one CPU rank. For each sequence length two tiny-Llama models with the same weights are
built: one with the project's local spec (``ContextParallelSDPAttention``: SDPA, the CP-capable
attention, here at CP=1) and one with megatron-core's ``DotProductAttention`` (materialised
``[b*h, s, s]`` scores, masked softmax). Blocks of forward+backward steps alternate between the two so
load changes on the machine hit both alike; prints the median step times and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import time

BLOCKS, STEPS_PER_BLOCK, WARMUP = 4, 3, 1
MICRO_BATCH = 2


def _models(seq: int):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.models.builder import build_gpt_model, layer_spec, transformer_config_for
    from megatron_recipes.models.context_parallel import ContextParallelSDPAttention
    from megatron_recipes.models.local_spec import _replace_modules

    cfg = compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", f"train.seq_length={seq}",
                                            f"model.max_position_embeddings={seq}", "precision=fp32"])
    config = transformer_config_for(cfg)
    ours = build_gpt_model(cfg, config=config, use_te=False)
    spec = _replace_modules(layer_spec(cfg, config, use_te=False), {ContextParallelSDPAttention: DotProductAttention})
    theirs = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=ours.vocab_size,
                      max_sequence_length=seq, position_embedding_type="rope")
    theirs.load_state_dict(ours.state_dict(), strict=False)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (MICRO_BATCH, seq))
    position_ids = torch.arange(seq).unsqueeze(0).expand(MICRO_BATCH, seq)
    return {"sdpa (ours)": ours, "mcore local": theirs}, tokens, position_ids


def _step(model, tokens, position_ids) -> float:
    start = time.perf_counter()
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(seqs) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed

    distributed.init_model_parallel(compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1"]))
    print(f"{'seq':>6} {'sdpa (ours) s/step':>20} {'mcore local s/step':>20} {'ratio ours/mcore':>18}")
    for seq in seqs:
        models, tokens, position_ids = _models(seq)
        times = {name: [] for name in models}
        for name, model in models.items():
            for _ in range(WARMUP):
                _step(model, tokens, position_ids)
        for _ in range(BLOCKS):
            for name, model in models.items():
                times[name] += [_step(model, tokens, position_ids) for _ in range(STEPS_PER_BLOCK)]
        ours, theirs = (statistics.median(times[n]) for n in models)
        print(f"{seq:>6} {ours:>20.3f} {theirs:>20.3f} {ours / theirs:>18.2f}", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [512, 2048])
