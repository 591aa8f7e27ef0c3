"""The simulated engine's ``/v1/chat/completions/derender``: generate answers back into chat completions.

Non-streaming: a ``generate_response`` becomes a ``chat.completion`` (content decoded from the ids, cut at the stop
string named by ``stop_reason``; log-probs with token strings). Streaming: one call per generate chunk, with the
``stream_state`` the previous answer returned (``None`` first); the answer is ``{chunk, stream_state}``. The state
is opaque to the client (as vLLM's is): here it holds every output id so far and how much text was sent, so a
multi-byte character split across chunks and a stop string (known from ``chat_request.stop``) are never sent half.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from worker.simulated.engine import BYTE_OFFSET, IM_END, IM_START, ByteTokenizer

__all__ = ("derender_chat", "derender_chat_chunk")

_SPECIAL_NAMES = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


_STRINGS: dict[int, tuple[str, list[int]]] = {}
"""Per id, its token string and that string's UTF-8 bytes (built once per id: the vocabulary is tiny)."""


def _token_string(tokenizer: ByteTokenizer, token: int) -> tuple[str, list[int]]:
    known = _STRINGS.get(token)
    if known is None:
        text = _SPECIAL_NAMES.get(token) or tokenizer.decode([token])
        known = _STRINGS[token] = (text, list(text.encode()))
    return known


def _text(ids: Sequence[int], *, final: bool) -> str:
    """The text of *ids*; before the end, an incomplete trailing character is held back."""
    raw = bytes(token - BYTE_OFFSET for token in ids if token >= BYTE_OFFSET)
    if final:
        return raw.decode("utf-8", errors="replace")
    for cut in range(len(raw), max(len(raw) - 4, -1), -1):
        try:
            return raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", errors="replace")


def _visible(ids: Sequence[int], stop_reason: Any, *, final: bool, stops: Sequence[str]) -> str:
    text = _text(ids, final=final)
    if final and isinstance(stop_reason, str) and stop_reason in text:
        return text[: text.index(stop_reason)]
    if not final and stops:
        return text[: max(len(text) - max(len(stop) for stop in stops) + 1, 0)]
    return text


def _logprobs(tokenizer: ByteTokenizer, choice: dict[str, Any]) -> dict[str, Any] | None:
    entries = (choice.get("logprobs") or {}).get("content")
    if entries is None:
        return None
    out = []
    for entry in entries:
        token, raw = _token_string(tokenizer, entry["token_id"])
        out.append({"token": token, "logprob": entry["logprob"], "bytes": list(raw), "top_logprobs": []})
    return {"content": out}


def _stops(request: dict[str, Any]) -> list[str]:
    stop = (request.get("chat_request") or {}).get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def derender_chat(tokenizer: ByteTokenizer, request: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` of a non-streaming derender request.

    :raises ValueError: no ``generate_response`` with one choice.
    """
    generated = request.get("generate_response")
    if not isinstance(generated, dict) or len(generated.get("choices") or ()) != 1:
        raise ValueError("generate_response must be a generate answer with one choice")
    choice = generated["choices"][0]
    ids = choice.get("token_ids") or []
    content = _visible(ids, choice.get("stop_reason"), final=True, stops=())
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": None, "tool_calls": []}
    prompt_tokens = request.get("prompt_tokens") or 0
    return {
        "id": generated.get("request_id", "chatcmpl-sim"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model") or generated.get("model") or "simulated",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(tokenizer, choice),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "total_tokens": prompt_tokens + len(ids),
        },
    }


def derender_chat_chunk(tokenizer: ByteTokenizer, request: dict[str, Any]) -> dict[str, Any]:
    """``{chunk, stream_state}`` of one streaming derender request.

    :raises ValueError: no ``generate_chunk`` with one choice, or a malformed ``stream_state``.
    """
    generated = request.get("generate_chunk")
    if not isinstance(generated, dict) or len(generated.get("choices") or ()) != 1:
        raise ValueError("generate_chunk must be one streamed generate chunk with one choice")
    state = request.get("stream_state") or {"role_sent": False, "output_token_ids": [], "prefix_offset": 0}
    if not isinstance(state, dict) or not isinstance(state.get("output_token_ids"), list):
        raise TypeError("stream_state must be the state the previous derender answer returned")
    choice = generated["choices"][0]
    ids = [*state["output_token_ids"], *(choice.get("token_ids") or [])]
    final = choice.get("finish_reason") is not None
    text = _visible(ids, choice.get("stop_reason"), final=final, stops=_stops(request))
    sent = int(state.get("prefix_offset", 0))
    delta: dict[str, Any] = {
        "role": None if state["role_sent"] else "assistant",
        "content": text[sent:] or None,
        "reasoning": None,
    }
    chunk = {
        "id": generated.get("request_id", "chatcmpl-sim"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.get("model") or "simulated",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": _logprobs(tokenizer, choice),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": None,
            }
        ],
        "usage": None,
    }
    new_state = {**state, "role_sent": True, "output_token_ids": ids, "prefix_offset": max(sent, len(text))}
    return {"chunk": chunk, "stream_state": new_state}
