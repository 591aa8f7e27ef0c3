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
    """vLLM's chat stream for *payload*: a role chunk (with ``prompt_token_ids``), the reasoning, the tool calls, then
    the content chunk that ends the choice (its log-probs, ids, ``finish_reason``, ``stop_reason``), then the usage
    chunk when asked. vLLM splits the text over more chunks (one per engine step); the concatenation is the same."""
    base = {key: payload.get(key) for key in ("id", "object", "created", "model")}
    base["object"] = "chat.completion.chunk"
    fingerprint = {"system_fingerprint": payload.get("system_fingerprint")}
    events = []
    for choice in payload.get("choices") or ():
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        head = {"prompt_token_ids": payload.get("prompt_token_ids"), "prompt_text": None}
        events.append(_event({**base, "choices": [role], **head}))
        pending = {"index": index, "logprobs": None, "finish_reason": None, "token_ids": None}
        reasoning = [field for field in ("reasoning", "reasoning_content") if message.get(field)]  # vLLM's, older
        events += [_event({**base, "choices": [{**pending, "delta": {field: message[field]}}]}) for field in reasoning]
        calls = message.get("tool_calls") or []
        if calls:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            events.append(_event({**base, "choices": [{**pending, "delta": delta}]}))
        last = {
            **pending,
            "delta": {"content": message.get("content") or ""},
            "logprobs": choice.get("logprobs"),
            "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"),
            "token_ids": choice.get("token_ids"),
        }
        events.append(_event({**base, "choices": [last], **({} if include_usage else fingerprint)}))
    if include_usage:
        usage = {key: value for key, value in (payload.get("usage") or {}).items() if value is not None}
        events.append(_event({**base, "choices": [], "usage": usage, **fingerprint}))
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
