"""One rank's generation: the checkpoint's model at a layout, run through megatron-core's inference engine.

The model is the one ``train`` builds (``models.builder``), its weights loaded through the checkpoint
package (any saved layout; a PEFT run: its base, then its adapters), wrapped by megatron-core's
``GPTInferenceWrapper`` with a ``StaticInferenceContext`` (the KV cache) and driven by its
``TextGenerationController`` under ``StaticInferenceEngine``'s static-batch loop: prefill to the shortest
prompt, then one decode step per token, the pipeline's last stage broadcasting logits so every rank
samples the same token (TP-gathered, padded vocabulary masked). megatron-core's own dynamic engine is
not used: it needs CUDA (its block allocator, CUDA graphs), and the static loop is what the CPU lane and
a token-for-token comparison with transformers need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ParallelConfig, RunConfig


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_k: int
    top_p: float
    seed: int


@dataclass
class Job:
    """What every rank runs: the same checkpoint, layout and token ids."""

    ckpt: str
    parallel: ParallelConfig
    dtype: str
    prompts: List[List[int]]
    sampling: Sampling
    termination_id: int
    batch_size: int


def generation_config(ckpt: Path, parallel: ParallelConfig, dtype: str, world: int) -> RunConfig:
    """The checkpoint's recipe at ``parallel`` in ``dtype`` (no FP8: generation reads the stored weights)."""
    from megatron_recipes.convert.verify import checkpoint_config

    cfg = checkpoint_config(ckpt, parallel, world)  # float32, vocabulary padded to the stored rows
    if dtype != "fp32":
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, name=dtype, params_dtype=dtype))
    return cfg


def _peft_active(cfg: RunConfig) -> bool:
    from megatron_recipes.peft.state import peft_active

    return peft_active(cfg)


def load_model(cfg: RunConfig, ckpt: Path) -> torch.nn.Module:
    """The one model chunk of this rank with the checkpoint's weights (a PEFT run: base + adapters)."""
    from megatron_recipes.models.builder import build_model_chunks

    chunks = build_model_chunks(cfg)
    if _peft_active(cfg):
        from megatron_recipes.peft.state import prepare_for_training

        this = dataclasses.replace(cfg.checkpoint, load=str(ckpt))
        start = checkpoint.start_of(dataclasses.replace(cfg, checkpoint=this), adapters_only=True)
        start.load_weights(chunks)  # the run's base, found as the run found it
        prepare_for_training(cfg, chunks)  # the adapters, as trained
        checkpoint.load(start.resume_from, chunks, None, None, cfg=cfg)
    else:
        checkpoint.load_weights(ckpt, chunks, cfg)
    model = chunks[0]
    model.eval()
    return model


class _IdsOnly:
    """The tokenizer megatron-core's controller is given: ids in, ids out; the launching side makes text."""

    bos = None

    def __init__(self, termination_id: int) -> None:
        self.eod = termination_id

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError("generate passes token ids; text is tokenized before the engine")

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def offsets(self, ids, text):
        return [0] * len(ids)


Ended = Callable[[Sequence[int]], bool]  # the text side's judgement: has this answer so far ended?


Observe = Callable[[int, List[int]], None]  # (row, its answer so far) after each token: serve's streaming, rank 0 only


def finished_rows(tokens: torch.Tensor, position: int, started: torch.Tensor, done: torch.Tensor, lengths: torch.Tensor,
                  ended: Optional[Ended], observe: Optional[Observe] = None) -> torch.Tensor:
    """``done`` with the rows whose answer (its ``lengths`` newest ids, ending at ``position``) has ``ended``;
    ``observe`` sees each unfinished row's answer so far (it must not decide anything: other ranks lack it)."""
    done = done.clone()
    for row in (started & ~done).nonzero().flatten().tolist():
        count = int(lengths[row])
        answer = tokens[row, position + 1 - count : position + 1].tolist() if count else []
        if observe is not None and count:
            observe(row, answer)
        if count and ended is not None and ended(answer):
            done[row] = True
    return done


def _controller_class():
    """megatron-core's controller, also stopping a sequence where ``ended`` says (other stop ids, stop texts).

    Its static loop stops at one termination id; it asks ``update_generation_status`` after each token on
    every rank with the same ids, so every rank stops the same rows.
    """
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    class StoppingController(TextGenerationController):
        ended: Optional[Ended] = None
        observe: Optional[Observe] = None

        def update_generation_status(self, updated_prompts_tokens, generation_started, current_context_end_position, *args, **kwargs):
            done, lengths = super().update_generation_status(updated_prompts_tokens, generation_started, current_context_end_position, *args, **kwargs)
            if self.ended is None and self.observe is None:
                return done, lengths
            return finished_rows(updated_prompts_tokens, current_context_end_position, generation_started, done, lengths,
                                 self.ended, self.observe), lengths

    return StoppingController


def _wrapped_model(model, cfg: RunConfig, max_requests: int, max_sequence: int):
    """GPTInferenceWrapper + StaticInferenceContext (the KV cache), in the installed megatron-core's API."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    try:  # megatron-core 0.16: a wrapper config carries the sizes
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    except ImportError:  # later: the context carries them
        return GPTInferenceWrapper(model, StaticInferenceContext(max_requests, max_sequence))
    config = InferenceWrapperConfig(
        hidden_size=cfg.model.hidden_size,
        params_dtype=next(model.parameters()).dtype,
        inference_batch_times_seqlen_threshold=-1,  # pipeline stages pass the whole batch at once
        padded_vocab_size=derived.padded_vocab_size(cfg.model, cfg.parallel.tp),
        inference_max_requests=max_requests,
        inference_max_seq_length=max_sequence,
    )
    return GPTInferenceWrapper(model, config, StaticInferenceContext.from_config(config))


def _sampling_params(s: Sampling):
    from megatron.core.inference.sampling_params import SamplingParams

    if s.temperature == 0:  # greedy: megatron-core's sampler takes argmax at top_k=1
        return SamplingParams(temperature=1.0, top_k=1, top_p=0.0, num_tokens_to_generate=s.max_new_tokens)
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=float(s.top_p), num_tokens_to_generate=s.max_new_tokens)


def check_lengths(cfg: RunConfig, prompts: List[List[int]], max_new_tokens: int) -> int:
    """The longest sequence the KV cache must hold; beyond the model's positions it is an error."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    limit = cfg.model.max_position_embeddings
    if longest > limit:
        raise RecipeError(
            f"the longest prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens={max_new_tokens} = {longest} "
            f"exceeds the model's {limit} positions",
            fix=f"use max_new_tokens<={max(1, limit - max(len(p) for p in prompts))} or a shorter prompt",
        )
    return longest


def model_for(ckpt: str, parallel: ParallelConfig, dtype: str, check: Optional[Callable[[RunConfig], object]] = None):
    """(cfg, model chunk) of this rank: process groups at ``parallel``, the checkpoint's weights loaded;
    ``check`` sees the config first (a refusal before any group or weight)."""
    from megatron_recipes.runtime.distributed import init_model_parallel

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cfg = generation_config(Path(ckpt), parallel, dtype, world)
    if check is not None:
        check(cfg)
    init_model_parallel(cfg)
    with contextlib.redirect_stdout(sys.stderr):  # what was loaded is a note; stdout holds the answers only
        model = load_model(cfg, Path(ckpt))
    return cfg, model


def generate_ids(job: Job, ended: Optional[Ended] = None, loaded=None, observe: Optional[Observe] = None) -> Optional[List[List[int]]]:
    """Run ``job`` on this rank (every rank of the layout calls it); rank 0 gets the generated ids.

    ``ended``: asked after each new token, besides ``job.termination_id`` (every rank must judge alike).
    ``loaded``: ``model_for``'s (cfg, model) when the caller has it already (``eval``).
    """
    from megatron_recipes.runtime import patches

    fits = lambda cfg: check_lengths(cfg, job.prompts, job.sampling.max_new_tokens)  # noqa: E731
    cfg, model = loaded or model_for(job.ckpt, job.parallel, job.dtype, check=fits)
    model.eval()
    longest = fits(cfg)
    patches.apply("inference")
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest

    batch = min(job.batch_size, len(job.prompts))
    controller = _controller_class()(_wrapped_model(model, cfg, batch, longest), _IdsOnly(job.termination_id))
    controller.ended = ended
    controller.observe = observe
    controller.sampling_rng.manual_seed(job.sampling.seed)
    with warnings.catch_warnings():  # chosen on purpose: its static batch and KV cache are what generate needs
        warnings.filterwarnings("ignore", message="The static engine will be deprecated", category=UserWarning)
        engine = StaticInferenceEngine(controller, max_batch_size=batch, random_seed=job.sampling.seed, legacy=True)
    params = _sampling_params(job.sampling)
    requests = [
        InferenceRequest(request_id=str(i), prompt="", prompt_tokens=list(ids), sampling_params=params)
        for i, ids in enumerate(job.prompts)
    ]
    with torch.inference_mode():
        done = engine.generate(inference_requests=requests)
    if torch.distributed.get_rank() != 0:
        return None
    return [[int(t) for t in request.generated_tokens.tolist()] for request in done]
