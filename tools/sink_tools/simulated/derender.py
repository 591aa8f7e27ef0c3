"""The simulated engine's ``/v1/chat/completions/derender``: generate answers back into chat completions, as vLLM 0.32.

Non-streaming: a ``generate_response`` becomes a ``chat.completion``: the text of the given ids (specials skipped;
shown by name when a parser applies, as vLLM keeps them for its parsers), the engine's parsers run on it
(:mod:`sink_tools.simulated.parsers`: reasoning on a reasoning engine, tool calls when ``chat_request`` names tools), the
stop string **kept** in the text, ``finish_reason`` and ``stop_reason`` as given (``"stop"`` even for a tool call),
log-probs built from the given ``logprobs.content`` (token strings and bytes; independent of the ids),
``usage.completion_tokens`` the number of given ids, ``system_fingerprint`` null. A reasoning engine refuses a request
without ``chat_request`` (400), as vLLM does when a parser is configured.

Streaming: one call per generate chunk, with the ``stream_state`` the previous answer returned (``None`` first); the
answer is ``{chunk, stream_state}``. The state is opaque to the client (as vLLM's is): here it holds every output id
so far and how much reasoning and content text was sent, so a multi-byte character split across chunks and a stop
string (known from ``chat_request.stop``) are never sent half.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sink_tools.simulated.chat_extras import ReasoningField
from sink_tools.simulated.parsers import Parsed, message_of, parse, text_of, token_string

__all__ = ("Derender", "logprob_entry")

_PARSER_NEEDS_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain detokenization would leak "
    "raw parser markup into content."
)
_EMPTY_RESPONSE_FIELDS = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                          "ec_transfer_params", "metrics")  # fmt: skip


def logprob_entry(
    token: int, logprob: Any, top: Sequence[tuple[int, Any]] | None, *, as_ids: bool = False
) -> dict[str, Any]:
    """One chat log-prob entry: the token's string and bytes, its log-prob, and *top* (``(id, log-prob)`` pairs).

    *as_ids* (``return_tokens_as_token_ids``): the strings read ``"token_id:<n>"``; as vLLM 0.32, the entry's bytes
    stay the token's own and each top entry's are those of its ``"token_id:<n>"`` string.
    """

    def spelled(i: int) -> str:
        return f"token_id:{i}" if as_ids else token_string(i)

    entry: dict[str, Any] = {"token": spelled(token), "logprob": logprob, "bytes": list(token_string(token).encode())}
    entry["top_logprobs"] = [
        {"token": spelled(i), "logprob": lp, "bytes": list(spelled(i).encode())} for i, lp in top or ()
    ]
    return entry


def _logprobs(choice: dict[str, Any]) -> dict[str, Any] | None:
    entries = (choice.get("logprobs") or {}).get("content")
    if entries is None:
        return None
    return {
        "content": [
            logprob_entry(
                entry["token_id"],
                entry["logprob"],
                [(top["token_id"], top["logprob"]) for top in entry.get("top_logprobs") or ()],
            )
            for entry in entries
        ]
    }


def _one_choice(generated: Any, name: str) -> dict[str, Any]:
    if not isinstance(generated, dict) or len(generated.get("choices") or ()) != 1:
        raise ValueError(f"{name} must be a generate answer with one choice")
    choice: dict[str, Any] = generated["choices"][0]
    return choice


class Derender:
    """The derender route of one engine (its reasoning parser and served model)."""

    def __init__(self, reasoning_field: ReasoningField | None) -> None:
        self.reasoning_field = reasoning_field

    def _chat_request(self, request: dict[str, Any]) -> dict[str, Any] | None:
        chat_request = request.get("chat_request")
        if chat_request is not None and not isinstance(chat_request, dict):
            raise ValueError("chat_request must be a chat completions request")
        if chat_request is None and self.reasoning_field is not None:
            raise ValueError(_PARSER_NEEDS_REQUEST)
        return chat_request

    def _parses(self, chat_request: dict[str, Any] | None) -> bool:
        """Whether a parser applies (vLLM then keeps special tokens in the text it parses)."""
        return chat_request is not None and (self.reasoning_field is not None or bool(chat_request.get("tools")))

    def _parse(self, ids: Sequence[int], chat_request: dict[str, Any] | None) -> Parsed:
        keep = self._parses(chat_request)
        return parse(ids, chat_request or {}, reasoning=self.reasoning_field is not None, keep_specials=keep)

    def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        """The ``chat.completion`` of a non-streaming derender request.

        :raises ValueError: no ``generate_response`` with one choice, empty ids, or no ``chat_request`` on a
            reasoning engine.
        """
        generated = request.get("generate_response")
        choice = _one_choice(generated, "generate_response")
        assert isinstance(generated, dict)
        chat_request = self._chat_request(request)
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"choice {choice.get('index', 0)} has empty or null token_ids")
        parsed = self._parse(ids, chat_request)
        prompt_tokens = request.get("prompt_tokens") or 0
        return_ids = bool(chat_request and chat_request.get("return_token_ids"))
        return {
            "id": generated.get("request_id", "chatcmpl-sim"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model") or generated.get("model") or "simulated",
            "choices": [
                {
                    "index": 0,
                    "message": message_of(parsed, reasoning_field=self.reasoning_field, chat_route=False),
                    "logprobs": _logprobs(choice),
                    "finish_reason": choice.get("finish_reason"),
                    "stop_reason": choice.get("stop_reason"),
                    "token_ids": ids if return_ids else None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + len(ids),
                "completion_tokens": len(ids),
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            **dict.fromkeys(_EMPTY_RESPONSE_FIELDS),
        }

    def chunk(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{chunk, stream_state}`` of one streaming derender request.

        :raises ValueError: no ``generate_chunk`` with one choice, a malformed ``stream_state``, or no
            ``chat_request`` on a reasoning engine.
        """
        generated = request.get("generate_chunk")
        choice = _one_choice(generated, "generate_chunk")
        assert isinstance(generated, dict)
        chat_request = self._chat_request(request)
        state = request.get("stream_state") or {"role_sent": False, "output_token_ids": [], "sent": [0, 0]}
        if not isinstance(state, dict) or not isinstance(state.get("output_token_ids"), list):
            raise TypeError("stream_state must be the state the previous derender answer returned")
        ids = [*state["output_token_ids"], *(choice.get("token_ids") or [])]
        final = choice.get("finish_reason") is not None
        parsed = self._parse(ids, chat_request)
        stop = (chat_request or {}).get("stop") or []
        held = 0 if final else max((len(s) for s in ([stop] if isinstance(stop, str) else stop)), default=1) - 1
        content = parsed.content or ""
        if not final and (chat_request or {}).get("tools") and content.lstrip().startswith("["):
            content = ""  # maybe a tool call: held back until the end, as vLLM's pythonic parser does
        texts = [_settled(parsed.reasoning or "", ids, final, 0), _settled(content, ids, final, held)]
        sent = list(state.get("sent") or [0, 0])
        deltas = [text[done:] or None for text, done in zip(texts, sent, strict=True)]
        delta: dict[str, Any] = {"role": None if state["role_sent"] else "assistant", "content": deltas[1]}
        delta[self.reasoning_field or "reasoning"] = deltas[0]
        if final and parsed.tool_calls:
            message = message_of(parsed, reasoning_field=self.reasoning_field, chat_route=False)
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            delta["content"] = None
        chunk = {
            "id": generated.get("request_id", "chatcmpl-sim"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": request.get("model") or "simulated",
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": _logprobs(choice),
                    "finish_reason": choice.get("finish_reason"),
                    "stop_reason": choice.get("stop_reason"),
                    "token_ids": None,
                }
            ],
            "usage": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "system_fingerprint": None,
            "metrics": None,
        }
        new_state = {
            "role_sent": True,
            "output_token_ids": ids,
            "sent": [max(done, len(text)) for text, done in zip(texts, sent, strict=True)],
        }
        return {"chunk": chunk, "stream_state": new_state}


def _settled(text: str, ids: Sequence[int], final: bool, held: int) -> str:
    """The part of *text* safe to send before the end: no trailing U+FFFD of a character still arriving, and *held*
    characters kept back (a stop string may still complete)."""
    if final:
        return text
    if text.endswith("\ufffd") and text_of(ids[-3:]).endswith("\ufffd"):
        text = text.rstrip("\ufffd")
    return text[: max(len(text) - held, 0)]
