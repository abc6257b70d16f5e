"""Requests in, engine batches out: rank 0 gathers the waiting requests that can share a batch, every rank
of the layout runs that batch through megatron-core's engine, rank 0 hands each request its answer.

Why one batch at a time, from rank 0: every rank must run the same batch (tensor and pipeline ranks
exchange activations), so rank 0 broadcasts each batch's prompts and settings (``collectives``) and the
others only follow. Requests share a batch when the engine treats them alike: the same sampling, the same
stop strings and the same kind (a chat answer ends at the template's end of turn). A request whose client
went away before its batch started is dropped; one already running finishes with its batch (the static
engine's batch cannot lose a row midway on one rank only) and its answer is discarded.
"""

from __future__ import annotations

import dataclasses
import queue
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from megatron_recipes.serve.protocol import Request, Sampling

Makers = Callable[[str, Tuple[str, ...]], object]  # (kind, stop strings) -> a PromptMaker, alike on every rank


def _key(r: Request) -> tuple:
    return (r.kind, tuple(r.stop), r.sampling)


class Batcher:
    def __init__(self, ckpt: str, layout, dtype: str, loaded, makers: Makers, max_batch: int) -> None:
        self.ckpt, self.layout, self.dtype, self.loaded = ckpt, layout, dtype, loaded
        self.makers, self.max_batch = makers, max_batch
        self.inbox: "queue.Queue[Optional[Request]]" = queue.Queue()
        self.waiting: Deque[Request] = deque()
        self.batches = 0  # how many engine batches ran (the log's closing line)

    def submit(self, request: Request) -> None:
        self.inbox.put(request)

    def stop(self) -> None:
        self.inbox.put(None)

    # ----- rank 0 ---------------------------------------------------------------------------
    def _next_batch(self) -> Optional[List[Request]]:
        """The oldest waiting request and those that can share its batch; None to stop."""
        first = self.waiting.popleft() if self.waiting else self.inbox.get()
        if first is None:
            return None
        batch, kept = [first], deque()
        while True:  # what else is waiting now, without blocking
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.inbox.put(None)  # stop after this batch
                break
            self.waiting.append(item)
        while self.waiting:
            item = self.waiting.popleft()
            (batch if _key(item) == _key(first) and len(batch) < self.max_batch else kept).append(item)
        self.waiting = kept
        return [r for r in batch if not r.cancelled.is_set()]

    def lead(self) -> None:
        """Rank 0's loop (beside the HTTP server's thread), until ``stop``."""
        from megatron_recipes.runtime import collectives

        while True:
            batch = self._next_batch()
            if batch is None:
                self.release_followers()
                return
            if not batch:
                continue
            first = batch[0]
            payload = {"kind": first.kind, "stop": tuple(first.stop), "sampling": dataclasses.asdict(first.sampling),
                       "prompts": [r.ids for r in batch]}
            collectives.broadcast_objects([payload])
            try:
                answers = self._run(payload, batch)
            except Exception as exc:  # the requests hear of it; the server stops (the ranks may be out of step)
                for r in batch:
                    r.events.put(("error", f"generation failed: {type(exc).__name__}: {exc}"))
                raise
            for r, answer in zip(batch, answers):
                r.events.put(("done", answer))

    def release_followers(self) -> None:
        """Tell the other ranks there is no next batch (they return from ``follow``)."""
        from megatron_recipes.runtime import collectives

        collectives.broadcast_objects([None])

    # ----- every rank -----------------------------------------------------------------------
    def follow(self) -> None:
        """The other ranks' loop: run each batch rank 0 broadcasts, until it broadcasts None."""
        from megatron_recipes.runtime import collectives

        while True:
            payload = collectives.broadcast_objects([None])[0]
            if payload is None:
                return
            self._run(payload, None)

    def _run(self, payload: Dict, batch: Optional[List[Request]]):
        from megatron_recipes.generate.engine import Job, Sampling as EngineSampling, generate_ids

        maker = self.makers(payload["kind"], payload["stop"])
        s = Sampling(**payload["sampling"])
        engine_sampling = EngineSampling(s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed)
        prompts = payload["prompts"]
        job = Job(self.ckpt, self.layout, self.dtype, prompts, engine_sampling, maker.termination_id, len(prompts))
        streams = _Streams(maker, batch, s.max_tokens) if batch is not None else None
        generated = generate_ids(job, maker.ended, loaded=self.loaded, observe=streams.observe if streams else None)
        self.batches += 1
        if batch is None:
            return None
        from megatron_recipes.data.prompts import Prompt

        answers = [maker.answer(Prompt("", ids), out, s.max_tokens) for ids, out in zip(prompts, generated)]
        for row, answer in enumerate(answers):
            streams.finish(row, answer)
        return answers


class _Streams:
    """Text deltas for the streaming requests of a batch, as the engine adds tokens (rank 0 only).

    The tail that could still turn out to be the start of a stop text (or half a UTF-8 character) is held
    back, so the deltas put together always equal the final answer."""

    def __init__(self, maker, batch: List[Request], max_tokens: int) -> None:
        self.maker, self.batch, self.max_tokens = maker, batch, max_tokens
        self.sent = [""] * len(batch)
        self.hold = max((len(t) for t in maker.stop_texts), default=1) - 1

    def _emit(self, row: int, text: str) -> None:
        if text.startswith(self.sent[row]) and len(text) > len(self.sent[row]):
            self.batch[row].events.put(("delta", text[len(self.sent[row]):]))
            self.sent[row] = text

    def observe(self, row: int, ids: List[int]) -> None:
        if row >= len(self.batch) or not self.batch[row].stream:
            return
        from megatron_recipes.data.prompts import Prompt

        text = self.maker.answer(Prompt("", []), ids, self.max_tokens).text
        text = text[: max(0, len(text) - self.hold)]
        self._emit(row, text.rstrip("\ufffd"))

    def finish(self, row: int, answer) -> None:
        if self.batch[row].stream:
            self._emit(row, answer.text)
