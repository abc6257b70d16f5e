"""Conversations -> token ids with an exact answer-only loss mask.

The template renders growing prefixes of the conversation; the text each message adds is one segment,
and for an assistant turn the generation prompt (``<|im_start|>assistant\\n`` ...) is split off into
its own segment. Segments are tokenized separately and concatenated, so every token belongs to exactly
one segment and the mask (assistant answer + its end-of-turn marker) is exact by construction, never
inferred from character offsets. A template whose renders are not prefixes of each other cannot be
split this way; that is an error rather than a guessed mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.sft.formats import Message

Segment = Tuple[str, bool]  # (text, counts for the loss)


@dataclass
class TokenizedSample:
    ids: np.ndarray  # int32 [L]
    mask: np.ndarray  # bool [L]: True where the token is part of an answer


class ChatRenderer:
    """Renders conversations with one chat template and tokenizes them with an answer-only mask."""

    def __init__(self, hf_tokenizer, template: str, answer_only: bool = True) -> None:
        self.hf = hf_tokenizer
        self.template = template
        self.answer_only = answer_only
        self._backend = hf_tokenizer.backend_tokenizer
        self.counts = {"empty_answers": 0, "weight_0_turns": 0}

    def _render(self, messages: Sequence[Message], generation_prompt: bool, where: str) -> str:
        try:
            return self.hf.apply_chat_template(
                list(messages), chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja errors, raise_exception() calls in templates
            raise RecipeError(f"{where}: the chat template failed: {exc}", fix="check the conversation's roles and order") from None

    def segments(self, messages: Sequence[Message], where: str) -> List[Segment]:
        """The rendered conversation cut into (text, is_answer) pieces, in order."""
        out: List[Segment] = []
        done = ""
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = self._render(messages[:k], True, where) if k else self._render([], True, where)
                full = self._render(messages[: k + 1], False, where)
                self._check_prefix(done, prompt, where)
                self._check_prefix(prompt, full, where)
                out += [(prompt[len(done) :], False), (full[len(prompt) :], message.get("weight", 1) != 0)]
            else:
                full = self._render(messages[: k + 1], False, where)
                self._check_prefix(done, full, where)
                out.append((full[len(done) :], False))
            done = full
        return [(text, answer) for text, answer in out if text]

    @staticmethod
    def _check_prefix(prefix: str, text: str, where: str) -> None:
        if not text.startswith(prefix):
            raise RecipeError(
                f"{where}: the chat template does not render a conversation as the extension of its prefix, "
                "so answer tokens cannot be separated exactly",
                fix="use a prefix-stable template, e.g. data.chat_template=chatml",
            )

    def tokenize(self, conversations: Sequence[Tuple[str, Sequence[Message]]]) -> List[TokenizedSample]:
        """Tokenize many conversations; one batched Rust call for all their segments. ``counts`` adds up the
        assistant turns that teach only the end of turn (empty answers) and those kept out by weight 0."""
        for _, messages in conversations:
            for message in messages:
                if message["role"] == "assistant":
                    self.counts["weight_0_turns"] += message.get("weight", 1) == 0
                    self.counts["empty_answers"] += not message["content"].strip() and message.get("weight", 1) != 0
        pieces = [self.segments(messages, where) for where, messages in conversations]
        flat = [text for segs in pieces for text, _ in segs]
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        encoded = iter(encode(flat, add_special_tokens=False)) if flat else iter(())
        samples = []
        for segs in pieces:
            ids: List[int] = []
            mask: List[bool] = []
            for _, answer in segs:
                seg_ids = next(encoded).ids
                ids += seg_ids
                mask += [answer or not self.answer_only] * len(seg_ids)
            samples.append(TokenizedSample(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)))
        return samples
