"""The simulated engine's streamed ``/v1/chat/completions`` (``"stream": true``), chunked as vLLM 0.32 streams it.

A first chunk ``delta: {role: "assistant", content: ""}`` (with top-level ``prompt_token_ids``, null unless
``return_token_ids``), then one chunk per generated id: its text as ``delta.content`` (``delta.reasoning`` while the
reasoning parser holds it; a character cut across ids, a possible stop string and a possible pythonic tool call held
back until they settle), its log-prob entry, ``token_ids`` (null unless asked); an auto tool call arrives whole, as
``delta.tool_calls``, in the chunk of the id that completes it, and the ids after it (the end-of-turn) add
``content: ""``; the last chunk carries ``finish_reason`` and ``stop_reason``. With
``stream_options.include_usage`` a chunk with ``choices: []`` and ``usage`` follows; ``system_fingerprint`` rides on
the last chunk; then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from sink_tools.simulated.engine import Generation
from sink_tools.simulated.parsers import Parsed
from worker.asgi import Send, send_body

__all__ = ("chat_events", "send_events")


async def send_events(send: Send, chunks: Sequence[Any]) -> None:
    """Send *chunks* as one server-sent-events body ending with ``data: [DONE]``."""
    events = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    await send_body(send, 200, b"".join([*events, b"data: [DONE]\n\n"]), b"text/event-stream")


def _settled(text: str, *, held: int) -> str:
    text = text.rstrip("\ufffd")  # the start of a character whose other bytes are still to come
    return text[: max(len(text) - held, 0)]


def chat_events(
    payload: dict[str, Any],
    prompt: list[int],
    generation: Generation,
    parse_prefix: Callable[[list[int]], Parsed],
    *,
    stops: Sequence[str],
    include_usage: bool,
) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion whose whole answer is *payload* (see the module docstring)."""
    base = {key: payload[key] for key in ("id", "object", "created", "model")}
    base["object"] = "chat.completion.chunk"
    final = payload["choices"][0]
    message = final["message"]
    field = "reasoning_content" if "reasoning_content" in message else "reasoning"
    returned = final["token_ids"] is not None
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    chunks = [{**base, "choices": [first], "prompt_token_ids": prompt if returned else None, "prompt_text": None}]
    entries = (final.get("logprobs") or {}).get("content")
    stop = max((len(s) for s in stops), default=1) - 1
    sent = {field: 0, "content": 0}
    ids = generation.token_ids
    auto_calls = final["finish_reason"] == "tool_calls"
    calls_sent = False
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        calls_now = False
        if last:
            texts = {field: message.get(field) or "", "content": message.get("content") or ""}
            calls_now = bool(message.get("tool_calls")) and not calls_sent
        else:
            parsed = parse_prefix(ids[: index + 1])
            content = parsed.content or ""
            if auto_calls and content.lstrip().startswith("["):
                content = ""
            texts = {field: _settled(parsed.reasoning or "", held=0), "content": _settled(content, held=stop)}
            calls_now = auto_calls and bool(parsed.tool_calls) and not calls_sent
        delta = {key: text[sent[key] :] for key, text in texts.items() if text[sent[key] :]}
        sent = {key: max(sent[key], len(text)) for key, text in texts.items()}
        if calls_now:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
            calls_sent = True
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta or {"content": ""},
            "logprobs": {"content": [entries[index]]} if entries else None,
            "finish_reason": final["finish_reason"] if last else None,
        }
        if last:
            choice["stop_reason"] = final["stop_reason"]
        choice["token_ids"] = [token] if returned else None
        chunks.append({**base, "choices": [choice]})
    if include_usage:
        usage = {key: value for key, value in payload["usage"].items() if value is not None}
        chunks.append({**base, "choices": [], "usage": usage})
    chunks[-1]["system_fingerprint"] = payload["system_fingerprint"]
    return chunks
