"""OpenAI's completion and chat-completion request bodies, checked into one ``Request``.

Why by hand and not by pydantic models: every refusal must be one 4xx whose message names the field
(OpenAI's own error shape, ``{"error": {"message", "type", "param"}}``), whatever the client sent (a list
where a string belongs, a negative ``max_tokens``, a prompt longer than the model's positions).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, Dict, List, Optional


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> Dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Sampling:
    """What must be equal for requests to share one engine batch (megatron-core samples a batch alike)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclass
class Request:
    """One accepted request, waiting for or being generated; ``events`` carries its stream."""

    kind: str  # "completion" | "chat"
    ids: List[int]
    sampling: Sampling
    stream: bool
    stop: List[str]
    prompt: Any  # the prompt as the client sent it (text, or the messages)
    events: "Queue" = field(default_factory=Queue)  # ("delta", text) ... ("done", Answer) | ("error", message)
    cancelled: threading.Event = field(default_factory=threading.Event)


def _number(body: Dict, name: str, default, kind, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"'{name}' must be {bounds}, got {value}", name)
    return value


def stops_of(body: Dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def sampling_of(body: Dict, default_max: int) -> Sampling:
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is served", "n")
    temperature = _number(body, "temperature", 0.0, float, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0)
    top_k = _number(body, "top_k", 0, int, 0)
    top_p = 0.0 if top_p >= 1.0 else top_p  # OpenAI's 1.0 is "no nucleus filter", the engine's 0
    if temperature == 0:
        top_k, top_p = 0, 0.0  # greedy
    elif top_k and top_p:
        raise BadRequest("set 'top_k' or 'top_p', not both (megatron-core's sampler takes one filter)", "top_k")
    return Sampling(_number(body, "max_tokens", default_max, int, 1), temperature, top_k, top_p, _number(body, "seed", 1234, int))


def check_model(body: Dict, served: str) -> None:
    model = body.get("model", served)
    if model != served:
        raise BadRequest(f"model '{model}' is not served here; this endpoint serves '{served}'", "model", status=404)


def completion_prompt(body: Dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string", "prompt")
    return prompt


def chat_messages(body: Dict) -> List[Dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be {{'role': system|user|assistant, 'content': <text>}}", f"messages[{i}]")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise BadRequest("the last message must be the user's", "messages")
    return out


def check_length(ids: List[int], sampling: Sampling, positions: int) -> None:
    if len(ids) + sampling.max_tokens > positions:
        raise BadRequest(
            f"the prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's {positions} positions",
            "max_tokens" if len(ids) < positions else "prompt",
        )
