"""The HTTP routes, in OpenAI's shapes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
(both with ``stream``: server-sent events ending in ``data: [DONE]``).

Every refusal is one 4xx in OpenAI's error shape; anything else that goes wrong is a 500 with a message,
never a traceback in the body. Answers carry ``token_ids`` (the generated ids, as vLLM's extension names
them) so a client can compare them with ``generate --json``.
"""

import json
import time
import uuid
from typing import Any, Callable, Dict

from fastapi import Request as HttpRequest  # at module level: FastAPI reads route signatures' annotations here

from megatron_recipes.serve import protocol as p


def _choice(kind: str, answer) -> Dict[str, Any]:
    body = {"index": 0, "finish_reason": answer.finish_reason, "token_ids": answer.tokens, "logprobs": None}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": answer.text}
    else:
        body["text"] = answer.text
    return body


def _envelope(kind: str, name: str, rid: str) -> Dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": int(time.time()),
            "model": name}


def make_app(name: str, submit: Callable[[p.Request], None], encode: Callable[[str, Any], list], positions: int,
             default_max_tokens: int):
    """``encode(kind, prompt)``: the prompt's ids (chat: rendered with the run's template)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title=f"megatron-recipes serve: {name}", docs_url=None, redoc_url=None)

    @app.exception_handler(p.BadRequest)
    async def _bad(_, exc: p.BadRequest):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _broken(_, exc: Exception):
        return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None,
                                       "code": None}}, status_code=500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "megatron-recipes"}]}

    async def _body(request: HttpRequest) -> Dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise p.BadRequest(f"the request body is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise p.BadRequest("the request body must be a JSON object")
        return body

    def _accept(kind: str, body: Dict[str, Any]) -> p.Request:
        p.check_model(body, name)
        prompt = p.chat_messages(body) if kind == "chat" else p.completion_prompt(body)
        sampling = p.sampling_of(body, default_max_tokens)
        stop = p.stops_of(body)
        ids = encode(kind, prompt)
        p.check_length(ids, sampling, positions)
        request = p.Request(kind, ids, sampling, bool(body.get("stream")), stop, prompt)
        submit(request)
        return request

    def _wait(request: p.Request):
        while True:
            kind, value = request.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise RuntimeError(value)

    def _stream(kind: str, request: p.Request, rid: str):
        head = _envelope(kind, name, rid)
        head["object"] = "chat.completion.chunk" if kind == "chat" else "text_completion"
        try:
            while True:
                event, value = request.events.get()
                if event == "error":
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                    return
                if event == "delta":
                    piece = {"index": 0, "finish_reason": None}
                    piece.update({"delta": {"content": value}} if kind == "chat" else {"text": value})
                    yield f"data: {json.dumps({**head, 'choices': [piece]})}\n\n"
                else:  # done
                    last = {"index": 0, "finish_reason": value.finish_reason, "token_ids": value.tokens}
                    last.update({"delta": {}} if kind == "chat" else {"text": ""})
                    yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client went away (or the stream ended): a request not yet batched is dropped
            request.cancelled.set()

    async def _respond(kind: str, http: HttpRequest):
        request = _accept(kind, await _body(http))
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if request.stream:
            return StreamingResponse(_stream(kind, request, rid), media_type="text/event-stream")
        answer = await run_in_threadpool(_wait, request)
        usage = {"prompt_tokens": len(request.ids), "completion_tokens": len(answer.tokens),
                 "total_tokens": len(request.ids) + len(answer.tokens)}
        return {**_envelope(kind, name, rid), "choices": [_choice(kind, answer)], "usage": usage}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _respond("completion", http)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        return await _respond("chat", http)

    return app
