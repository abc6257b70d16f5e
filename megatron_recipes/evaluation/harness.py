"""lm-evaluation-harness on a Megatron checkpoint, without exporting it: an lm-eval model (``TemplateLM``)
whose three requests run on the checkpoint's megatron-core model at its layout.

``loglikelihood`` / ``loglikelihood_rolling``  ``scoring.score_rows`` (the pipeline schedule, forward only)
``generate_until``                             megatron-core's inference engine (``generate.engine``)

Why the requests are tokenized and cut as lm-eval's own ``hf`` model does (its ``tok_encode``, the context
left-truncated to ``max_length``, the answer decoded without special tokens and cut at the first ``until``
text): the scores must be the ones lm-eval gives the exported model, so that a checkpoint and its export
compare like for like. Only rank 0 runs lm-eval; each request batch is broadcast (``Ranks``) and every rank
of the layout runs it, as ``serve``'s batches are.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Sequence

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import _add_special_kwargs, handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
from lm_eval.models.utils import postprocess_generated_text

from megatron_recipes.evaluation.scoring import Row, score_rows

MAX_GEN_TOKS = 256  # lm-eval's default for a generation request that names none (as its hf model)


class Ranks:
    """Rank 0 hands each request batch to every rank of the layout; the others follow until released."""

    def __init__(self, loaded, plan, maker_for: Callable[[Sequence[str]], Any]) -> None:
        self.cfg, self.model = loaded
        self.loaded, self.plan, self.maker_for = loaded, plan, maker_for

    def lead(self, order: Dict[str, Any]):
        from megatron_recipes.runtime import collectives

        if self._shared():
            collectives.broadcast_objects([order])
        return self._run(order)

    def follow(self) -> None:
        from megatron_recipes.runtime import collectives

        while self._shared():
            order = collectives.broadcast_objects([None])[0]
            if order is None:
                return
            self._run(order)

    def release(self) -> None:
        from megatron_recipes.runtime import collectives

        if self._shared():
            collectives.broadcast_objects([None])

    @staticmethod
    def _shared() -> bool:
        import torch

        return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1

    def _run(self, order: Dict[str, Any]):
        if order["kind"] == "score":
            rows = [Row(list(t), list(c)) for t, c in order["rows"]]
            return score_rows(self.cfg, self.model, rows, self.plan.opts.batch_size)
        from megatron_recipes.generate.engine import Job, Sampling, generate_ids

        maker = self.maker_for(order["until"])
        sampling = Sampling(**order["sampling"])
        job = Job(str(self.plan.ckpt), self.plan.layout, self.plan.dtype, order["prompts"], sampling,
                  maker.termination_id, self.plan.opts.batch_size)
        return generate_ids(job, maker.ended, loaded=self.loaded)


class MegatronLM(TemplateLM):
    """lm-eval's view of the checkpoint (rank 0). ``tokenizer``: the run's HF tokenizer (its chat template)."""

    def __init__(self, ranks: Ranks, tokenizer, max_length: int, batch_size: int) -> None:
        super().__init__()
        self.ranks, self.tokenizer = ranks, tokenizer
        self._max_length, self._batch_size = max_length, batch_size

    # ----- what lm-eval asks of a model ------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len: Optional[int] = None,
                   **kwargs) -> List[int]:
        special = _add_special_kwargs(add_special_tokens, None)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ----- the three requests ----------------------------------------------------------------
    def _scores(self, pairs: Sequence[tuple]) -> List[tuple]:
        """(context ids, continuation ids) pairs -> (log-probability, greedy); longest first, in one order."""
        rows = [((ctx + cont)[-(self.max_length + 1):][:-1], cont) for ctx, cont in pairs]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        got = self.ranks.lead({"kind": "score", "rows": [rows[i] for i in order]})
        out: List[Optional[tuple]] = [None] * len(rows)
        for i, score in zip(order, got):
            out[i] = tuple(score)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[tuple]:
        results = self._scores([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """A document's log-probability in windows of ``max_length`` tokens (lm-eval's rolling windows)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._scores(windows) if windows else []):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Answers of requests sharing generation settings run as engine batches; each is cut at ``until``."""
        groups: Dict[str, List[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: List[str] = [""] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_gen
            if room <= 0:
                raise ValueError(f"max_gen_toks={max_gen} leaves no room for a prompt in the model's {self.max_length} positions")
            prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=room) for i in indices]
            sampling = _sampling(kwargs, max_gen)
            generated = self.ranks.lead({"kind": "generate", "prompts": prompts, "until": until, "sampling": sampling})
            for i, ids in zip(indices, generated):
                text = postprocess_generated_text(self.tok_decode(ids), stop=until, think_end_token=None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def _sampling(kwargs: Dict[str, Any], max_gen: int) -> Dict[str, Any]:
    """lm-eval's generation settings as the engine's (``do_sample`` false or temperature 0: greedy)."""
    temperature = float(kwargs.get("temperature") or 0.0)
    if not kwargs.get("do_sample") or temperature == 0.0:
        temperature = 0.0
    return {"max_new_tokens": max_gen, "temperature": temperature, "top_k": int(kwargs.get("top_k") or 0),
            "top_p": float(kwargs.get("top_p") or 0.0), "seed": int(kwargs.get("seed") or 1234)}
