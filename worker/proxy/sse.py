"""Server-sent events rebuilt from a complete, already-captured response (``"stream": true`` requests).

The capture proxy asks the upstream for the whole response, stages it, and only then emits the stream: the
agent gets a valid SSE stream (chunks, then ``data: [DONE]``) whose first byte leaves after the stage is durable.
The time to first token is therefore the whole generation time plus the stage (the trade-off for INV-1; contract §12.5).
"""

from __future__ import annotations

from typing import Any

import orjson

from worker.proxy.routes import RouteKind

__all__ = ("sse_events",)


def _event(payload: Any, name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


def _chat(payload: dict[str, Any], include_usage: bool) -> list[bytes]:
    base = {key: payload.get(key) for key in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    events = []
    for choice in payload.get("choices") or ():
        message = choice.get("message") or {}
        delta = {"role": "assistant", "content": message.get("content") or ""}
        for field in ("reasoning", "reasoning_content"):  # a reasoning parser's output rides along
            if message.get(field):
                delta[field] = message[field]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        first = {
            "index": choice.get("index", 0),
            "delta": delta,
            "logprobs": choice.get("logprobs"),
            "finish_reason": None,
        }
        if "token_ids" in choice:  # the agent asked for them (return_token_ids): vLLM streams them per chunk
            first["token_ids"] = choice["token_ids"]
        last = {
            "index": choice.get("index", 0),
            "delta": {},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if "stop_reason" in choice:
            last["stop_reason"] = choice["stop_reason"]
        head = {**base, "prompt_token_ids": payload["prompt_token_ids"]} if "prompt_token_ids" in payload else base
        events += [_event({**head, "choices": [first]}), _event({**base, "choices": [last]})]
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": payload.get("usage")}))
    return events


def _completions(payload: dict[str, Any], include_usage: bool) -> list[bytes]:
    base = {key: payload.get(key) for key in ("id", "created", "model")}
    base["object"] = "text_completion"
    events = [_event({**base, "choices": [choice]}) for choice in payload.get("choices") or ()]
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": payload.get("usage")}))
    return events


def _responses(payload: dict[str, Any]) -> list[bytes]:
    created = {**payload, "status": "in_progress", "output": []}
    return [
        _event({"type": "response.created", "response": created, "sequence_number": 0}, "response.created"),
        _event({"type": "response.completed", "response": payload, "sequence_number": 1}, "response.completed"),
    ]


def sse_events(route: RouteKind, payload: dict[str, Any], *, include_usage: bool = False) -> bytes:
    """The whole SSE body for *payload* (already stripped), ending with ``data: [DONE]``."""
    if route == "chat":
        events = _chat(payload, include_usage)
    elif route == "completions":
        events = _completions(payload, include_usage)
    else:
        return b"".join(_responses(payload))
    return b"".join([*events, b"data: [DONE]\n\n"])
