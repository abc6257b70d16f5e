"""SFT records -> a list of ``{"role", "content"}`` messages, whatever form the file uses.

Accepted forms (one JSON object per line):
  instruction  ``{"input": ..., "output": ...}`` (optional ``"instruction"``, ``"system"``)
  chat         ``{"messages": [{"role": ..., "content": ...}, ...]}``
  ShareGPT     ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``
Unknown roles are an error (a silently dropped turn would shift what the model learns to answer).
"""

from __future__ import annotations

import json
from typing import Dict, Iterator, List, Tuple

from megatron_recipes.config.errors import RecipeError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "tool": "tool"}
Message = Dict[str, str]


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise RecipeError(f"{where}: '{field}' must be text, got {type(value).__name__}", fix="fix the record")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's "\ud800" escape: a lone surrogate no tokenizer can encode
        raise RecipeError(f"{where}: '{field}' holds a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x}) at "
                          f"character {exc.start + 1}, which is not text", fix="fix or drop the record") from None
    return value


def _from_chat(turns, where: str, role_key: str, content_key: str, roles: Dict[str, str]) -> List[Message]:
    if not isinstance(turns, list) or not turns:
        raise RecipeError(f"{where}: the conversation is empty or not a list", fix="give at least one user and one assistant turn")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise RecipeError(f"{where}: turn {i} lacks '{role_key}'/'{content_key}'", fix=f"each turn is {{'{role_key}': ..., '{content_key}': ...}}")
        role = turn[role_key]
        if role not in roles:
            raise RecipeError(
                f"{where}: turn {i} has unknown role '{role}'",
                fix=f"use one of {', '.join(roles)} (or map it before training)",
            )
        message = {"role": roles[role], "content": _text(turn[content_key], where, f"turn {i} {content_key}")}
        if "weight" in turn:
            message.update(_weight(turn["weight"], message["role"], where, i))
        messages.append(message)
    return messages


def _weight(value, role: str, where: str, i: int) -> Message:
    """A turn's ``weight`` (axolotl's and LLaMA-Factory's spelling): 0 keeps an assistant turn out of the loss,
    1 is the default. Any other value, or a weight on another role, would be silently ignored: refused."""
    if isinstance(value, bool) or value not in (0, 1):
        raise RecipeError(f"{where}: turn {i} has weight {value!r}", fix="a turn's weight is 0 (not trained) or 1")
    if role != "assistant":
        raise RecipeError(f"{where}: turn {i} ({role}) has a weight, which only assistant turns honour",
                          fix="remove it: with data.answer_only_loss=true only assistant turns are trained")
    return {"weight": int(value)} if value == 0 else {}


def to_messages(record: dict, where: str) -> List[Message]:
    """The conversation held by one record, as role/content messages."""
    if not isinstance(record, dict):
        raise RecipeError(f"{where}: a record must be a JSON object", fix="one JSON object per line")
    if "messages" in record:
        return _from_chat(record["messages"], where, "role", "content", {r: r for r in ROLES})
    if "conversations" in record:
        return _from_chat(record["conversations"], where, "from", "value", SHAREGPT_ROLES)
    if "output" in record and ("input" in record or "instruction" in record):
        prompt = "\n\n".join(
            _text(record[k], where, k) for k in ("instruction", "input") if k in record and record[k] not in (None, "")
        )
        messages = [{"role": "system", "content": _text(record["system"], where, "system")}] if record.get("system") else []
        return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record["output"], where, "output")}]
    raise RecipeError(
        f"{where}: unknown record form (keys: {', '.join(sorted(record)) or 'none'})",
        fix='use {"input","output"}, {"messages":[{"role","content"}]} or {"conversations":[{"from","value"}]}',
    )


def read_conversations(path: str) -> Iterator[Tuple[str, List[Message]]]:
    """(where, messages) for every non-blank line of a JSONL file, in file order."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise RecipeError(f"SFT file '{path}' does not exist", fix="set data.sft_path to a JSONL file") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecipeError(f"{where}: bytes that are not UTF-8 at column {exc.start + 1}", fix="re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecipeError(f"{where}: invalid JSON ({exc.msg})", fix="one JSON object per line") from None
            yield where, to_messages(record, where)
