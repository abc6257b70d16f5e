"""The text side of a run's model: which tokenizer, how a prompt becomes ids, where an answer ends.

One owner for ``generate``, ``eval`` and the export's ``generation_config.json``. Every rank reads the same
files and so makes the same ids; the engine then sees token ids only.

- Tokenizer: ``tokenizer=``, else the run's ``data.tokenizer`` (a folder, or the built-in one), else
  the tokenizer files an import kept next to the checkpoint (``hf/``, also through ``checkpoint.pretrained``).
- A fine-tuned run's prompt is rendered with its chat template and tokenized segment by segment, exactly
  as ``data/sft`` rendered its training conversations, so the model sees the prefix it learned to answer.
- The tokenizer must hash to the one the checkpoint recorded (``run_tokenizer``): ids of another tokenizer
  name other tokens, silently. A run on an older built-in tokenizer finds it among the cached builds.
- An answer ends at the tokenizer's end-of-sequence token, the chat template's end-of-turn (one special
  token, e.g. the built-in or a Qwen tokenizer's ``<|im_end|>``; or its text, for a tokenizer that spells
  it in several tokens) or a ``stop=`` text. megatron-core's engine
  stops on one token id; ``ended`` is what the engine asks after each new token for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

_PLACEHOLDER = "x"  # an answer rendered only to find the text the template puts after one


@dataclass
class Prompt:
    text: str  # as the user gave it
    ids: List[int]  # what the model is fed


@dataclass
class Answer:
    prompt: str
    text: str
    tokens: List[int]  # generated ids, without the stop token
    finish_reason: str  # "stop" (end token or stop text) | "length" (max_new_tokens)

    def record(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason}


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def tokenizer_folder(cfg: RunConfig, ckpt: Path, explicit: Optional[str], build_builtin: bool = True):
    """The tokenizer to generate with (see the module docstring); a ``RecipeTokenizer``."""
    from megatron_recipes.checkpoint import hf_assets_beside
    from megatron_recipes.data.tokenizer import BUILTIN, load_tokenizer_dir, tokenizer_source

    if explicit:
        folder = Path(explicit).expanduser()
        if not _has_tokenizer(folder):
            raise RecipeError(f"tokenizer={explicit} holds no tokenizer.json/tokenizer_config.json", fix="point at a HF tokenizer folder")
        return load_tokenizer_dir(folder)
    if cfg.data.tokenizer != BUILTIN:
        return tokenizer_source(cfg.data.tokenizer, cfg)
    assets = hf_assets_beside(ckpt, cfg)
    if assets is not None and _has_tokenizer(assets):
        return load_tokenizer_dir(assets)
    if cfg.data.kind in ("builtin", "sft"):  # trained on the built-in tokenizer (built or reused from data.cache_dir)
        return tokenizer_source(BUILTIN, cfg, build_builtin)
    raise RecipeError(
        f"checkpoint '{ckpt}' names no tokenizer (data.tokenizer={cfg.data.tokenizer}, no tokenizer files beside it)",
        fix="pass tokenizer=<the HF tokenizer folder the model was trained with>",
    )


class TokenizerMismatch(RecipeError):
    """A tokenizer other than the one the checkpoint trained with."""


def run_tokenizer(cfg: RunConfig, ckpt: Path, meta: dict, explicit: Optional[str] = None, build_builtin: bool = True):
    """``tokenizer_folder``'s tokenizer, checked against the content hash ``ckpt`` recorded; for a run on the
    built-in tokenizer whose build has changed since, the cached build it trained with."""
    from megatron_recipes.checkpoint import IDENTITY_KEY
    from megatron_recipes.data.tokenizer import BUILTIN, load_tokenizer_dir

    tokenizer = tokenizer_folder(cfg, ckpt, explicit, build_builtin)
    recorded = (meta.get(IDENTITY_KEY) or {}).get("tokenizer_sha")
    found = tokenizer.unique_identifiers.get("tokenizer_sha")
    if not recorded or found == recorded:
        return tokenizer
    if not explicit and cfg.data.tokenizer == BUILTIN:
        from megatron_recipes.data.builtin import cached_tokenizer_dirs

        for folder in cached_tokenizer_dirs(cfg.data):
            older = load_tokenizer_dir(folder)
            if older.unique_identifiers.get("tokenizer_sha") == recorded:
                return older
    raise TokenizerMismatch(
        f"the tokenizer at {tokenizer.source} is not the one checkpoint '{ckpt}' was trained with "
        f"(content hash {found}, the checkpoint recorded {recorded}): its ids would name other tokens",
        fix="pass the folder of the tokenizer the run trained with (tokenizer=, or hf_assets= for an export)",
    )


def wants_chat(cfg: RunConfig, requested: Optional[bool]) -> bool:
    """Chat template for fine-tuned runs (``data.kind=sft``) unless ``chat=`` says otherwise."""
    return cfg.data.kind == "sft" if requested is None else bool(requested)


class PromptMaker:
    """Prompt text -> ids (plain, or through the run's chat template), and where an answer ends."""

    def __init__(self, tokenizer, cfg: RunConfig, chat: bool, stop: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.hf = tokenizer.hf
        self.renderer = None
        self.stop_ids = {int(tokenizer.eod)}
        if getattr(self.hf, "eos_token_id", None) is not None:
            self.stop_ids.add(int(self.hf.eos_token_id))
        self.stop_texts: List[str] = [stop] if stop else []
        self.end_of_turn: Optional[int] = None
        if chat:
            from megatron_recipes.data.sft.render import ChatRenderer
            from megatron_recipes.data.sft.templates import resolve_template

            template = resolve_template(cfg.data.chat_template, self.hf, tokenizer.source)
            self.renderer = ChatRenderer(self.hf, template)
            self._end_of_turn()
        self._window = max((len(t.encode("utf-8")) for t in self.stop_texts), default=0) + 1

    def add_stops(self, texts: Sequence[str]) -> "PromptMaker":
        """More stop texts (a served request's ``stop``), checked as ``stop=`` is."""
        self.stop_texts += [t for t in texts if t and t not in self.stop_texts]
        self._window = max((len(t.encode("utf-8")) for t in self.stop_texts), default=0) + 1
        return self

    def _segments(self, text: str, history: Sequence[dict] = ()) -> Tuple[List[str], str]:
        """The prompt's segments (earlier turns, the user turn, the generation prompt) and the text the
        template puts after a rendered answer."""
        messages = [*history, {"role": "user", "content": text}, {"role": "assistant", "content": _PLACEHOLDER}]
        segments = self.renderer.segments(messages, "generate")
        last_answer = max(i for i, (_, answer) in enumerate(segments) if answer)  # the placeholder
        after = segments[last_answer][0]
        return [s for s, _ in segments[:last_answer]], after[len(_PLACEHOLDER):] if after.startswith(_PLACEHOLDER) else ""

    def _end_of_turn(self) -> None:
        """What the template closes an answer with: a special token's id, else its text as a stop text."""
        _, after = self._segments("?")
        ids = self.hf(after, add_special_tokens=False)["input_ids"] if after else []
        special = set(self.hf.all_special_ids) | set(getattr(self.hf, "added_tokens_decoder", {}) or {})
        if ids and ids[0] in special:
            self.end_of_turn = int(ids[0])
            self.stop_ids.add(self.end_of_turn)
        elif after.strip():  # fine-tuning taught the model these characters, token by token
            self.stop_texts.insert(0, after.strip())

    @property
    def termination_id(self) -> int:
        """The one id megatron-core's engine stops a sequence at: end-of-turn in chat, else end-of-sequence."""
        return self.end_of_turn if self.end_of_turn is not None else int(self.tokenizer.eod)

    def encode(self, text: str, history: Sequence[dict] = ()) -> Prompt:
        """Ids of a prompt; in chat, after ``history`` (earlier messages of the conversation: eval's
        multi-turn validation conversations)."""
        if self.renderer is None:  # as a HF user's tokenizer(text) would: with its BOS, if it adds one
            return Prompt(text, list(self.hf(text)["input_ids"]))
        pieces, _ = self._segments(text, history)
        ids: List[int] = []
        for piece in pieces:
            ids += self.hf(piece, add_special_tokens=False)["input_ids"]
        return Prompt(text, ids)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.hf.decode(list(tokens), skip_special_tokens=True)

    def ended(self, generated: Sequence[int]) -> bool:
        """Whether the answer so far (checked after each new token) has reached a stop id or stop text.

        A stop text first appears with the newest token, so it lies in the last ``len(text in bytes)``
        tokens (each decodes to one byte or more): only that tail is decoded.
        """
        if not generated:
            return False
        if int(generated[-1]) in self.stop_ids:
            return True
        if not self.stop_texts:
            return False
        tail = self._decode(generated[-self._window:])
        return any(t in tail for t in self.stop_texts)

    def answer(self, prompt: Prompt, generated: Sequence[int], max_new_tokens: int) -> Answer:
        """Cut at the first stop id, then before the first stop text; decode."""
        tokens = [int(t) for t in generated]
        cut = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        stopped = cut is not None or len(tokens) < max_new_tokens
        tokens = tokens[:cut] if cut is not None else tokens
        text = self._decode(tokens)
        found = [text.index(t) for t in self.stop_texts if t in text]
        if found:
            text = text[: min(found)]
            # the fewest tokens that spell the kept text: a token that only starts the stop text's first
            # character (one byte of several) belongs to the stop text
            keep = next(n for n in range(len(tokens) + 1) if self._decode(tokens[:n]).startswith(text))
            tokens, stopped = tokens[:keep], True
        return Answer(prompt.text, text, tokens, "stop" if stopped else "length")
