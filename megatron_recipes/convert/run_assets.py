"""What an export carries beside the weights so that transformers runs it as the run ran: the tokenizer
the run trained with and a ``generation_config.json`` that stops where the run's answers stop.

Why: an export of a run on the built-in tokenizer (or of a fine-tuning run) had no tokenizer at all, and
greedy ``generate`` ran past the end of the answer because nothing named the end token. The tokenizer is
found and checked as ``generate`` finds it (``data/prompts.run_tokenizer``): it must hash to the tokenizer the
checkpoint recorded (``meta.json``'s ``run_identity``): an export never ships another tokenizer under the
run's weights. A fine-tuning run's tokenizer carries the chat template it was trained with, so
``apply_chat_template`` renders prompts as training did. Where an answer ends is ``PromptMaker``'s
judgement (one owner): end-of-sequence and end-of-turn token ids become ``eos_token_id``; an end of turn
the tokenizer spells in several tokens becomes ``stop_strings`` (transformers' ``generate`` then needs
``tokenizer=``, which lm-eval's hf model does not pass: the built-in tokenizer has its turn markers as tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


@dataclass
class RunAssets:
    """The tokenizer files and the generation config written into an export (what the summary says)."""

    tokenizer_from: Optional[str] = None
    eos_token_ids: List[int] = field(default_factory=list)
    stop_strings: List[str] = field(default_factory=list)
    chat_template: bool = False
    missing: Optional[str] = None  # why no tokenizer was written

    def summary(self) -> str:
        if self.tokenizer_from is None:
            return f"no tokenizer written ({self.missing}); pass hf_assets=<the run's tokenizer folder> to include it"
        stops = f", stop_strings {self.stop_strings}" if self.stop_strings else ""
        chat = ", with the run's chat template" if self.chat_template else ""
        return f"tokenizer from {self.tokenizer_from}{chat}; generation_config.json eos_token_id {self.eos_token_ids}{stops}"


def _run_tokenizer(cfg: RunConfig, resolved: Path, meta: Dict[str, Any], explicit: Optional[Path]):
    """``hf_assets=`` when it holds a tokenizer, else the run's own (``data.tokenizer``, the import's, built-in),
    checked against the hash the checkpoint recorded (``data/prompts.run_tokenizer``)."""
    from megatron_recipes.data.prompts import TokenizerMismatch, run_tokenizer

    if explicit is not None and has_tokenizer(explicit):
        return run_tokenizer(cfg, resolved, meta, str(explicit)), None
    try:
        return run_tokenizer(cfg, resolved, meta, None, build_builtin=False), None
    except TokenizerMismatch:
        raise
    except RecipeError as exc:
        return None, exc.message  # a checkpoint whose tokenizer is not here still exports its weights; the summary says so


def _generation_config(base: Dict[str, Any], maker, tokenizer) -> Dict[str, Any]:
    eos = sorted(maker.stop_ids)
    own = base.get("eos_token_id")
    own = own if isinstance(own, list) else ([own] if own is not None else [])
    config = dict(base)
    ids = sorted(set(eos) | {int(i) for i in own})
    config["eos_token_id"] = ids[0] if len(ids) == 1 else ids  # one id as a number, as HF configs write it
    if maker.stop_texts:
        config["stop_strings"] = list(dict.fromkeys(list(base.get("stop_strings") or []) + maker.stop_texts))
    hf = tokenizer.hf
    if config.get("bos_token_id") is None and getattr(hf, "bos_token_id", None) is not None:
        config["bos_token_id"] = int(hf.bos_token_id)
    if config.get("pad_token_id") is None:
        config["pad_token_id"] = int(tokenizer.pad_or_eod)
    return config


class RunTokenizer:
    """The run's tokenizer, found and checked before any weight is written (a refusal then costs nothing)."""

    def __init__(self, cfg: RunConfig, resolved: Path, meta: Dict[str, Any], explicit: Optional[Path]) -> None:
        self.cfg = cfg
        self.tokenizer, self.missing = _run_tokenizer(cfg, resolved, meta, explicit)

    def write(self, out: Path, copied_from: Optional[Path]) -> RunAssets:
        """The tokenizer and ``generation_config.json`` into ``out``; ``copied_from``: the folder whose files
        were copied there already (kept as they are when they are the run's tokenizer, unchanged)."""
        from megatron_recipes.data.prompts import PromptMaker, wants_chat

        tokenizer = self.tokenizer
        if tokenizer is None:
            return RunAssets(missing=self.missing)
        chat = wants_chat(self.cfg, None)
        maker = PromptMaker(tokenizer, self.cfg, chat)
        hf = tokenizer.hf
        if chat and maker.renderer is not None:
            hf.chat_template = maker.renderer.template
        same_files = copied_from is not None and Path(tokenizer.source).resolve() == Path(copied_from).resolve()
        if chat or not same_files:
            hf.save_pretrained(str(out))
        base_path = out / GENERATION_CONFIG
        base = json.loads(base_path.read_text(encoding="utf-8")) if base_path.is_file() else {}
        config = _generation_config(base, maker, tokenizer)
        base_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        eos = config["eos_token_id"]
        return RunAssets(str(tokenizer.source), eos if isinstance(eos, list) else [eos], list(config.get("stop_strings") or []), chat)
