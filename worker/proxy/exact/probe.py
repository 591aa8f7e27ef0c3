"""The start-up probe of exact-prefix mode: does the engine serve the token-in/token-out routes, and what is its
template's end-of-turn id?

Routes: ``POST /v1/chat/completions/render`` must answer 200 (vLLM 0.32 with ``--enable-scale-out``; 403
``PermissionDeniedError`` means the flag is missing, 404 an engine without the routes), and
``POST /v1/chat/completions/derender`` must exist (an empty body is a 4xx validation error, not 403/404).

End-of-turn id, learned from the engine's own template (no tokenizer needed here): render ``[user "a"]``, then
``[user "a", assistant ""]`` and ``[user "a", assistant "z"]`` without the generation prompt. The two assistant
turns (each rendering past the first) share a header and a closing; the closing (what follows the content) starts
with the end-of-turn id: ``<|im_end|>`` in ``<|im_end|>\\n``. A template for which this does not hold (the user
turn renders differently once an assistant turn follows, or no closing) keeps verify mode, with the reason.

What the chat route answers that derender cannot tell (:class:`worker.proxy.exact.chat.EngineTraits`), learned from one
chat completion of an empty reply (the end-of-turn forced by a ``logit_bias``, one token generated): its
``system_fingerprint``, its parsers' message for no text (``content: null`` where a reasoning parser takes the whole
output), and whether its usage reports reasoning tokens; then, with a reasoning parser, its ``<think>`` and
``</think>`` ids (``POST /tokenize``) to count reasoning tokens as vLLM's think-style parsers do. A failing chat
call leaves the defaults (no fingerprint, ``content: ""``): the mode is still exact.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from worker.proxy.exact.chat import DERENDER_PATH, RENDER_PATH, EngineCall, EngineTraits

__all__ = ("EngineGet", "ExactProbe", "probe_exact_prefix")

EngineGet = Callable[[str], Awaitable[tuple[int, Any]]]
"""``path -> (status, parsed JSON body)`` of a GET on the engine."""


@dataclass(frozen=True)
class ExactProbe:
    """What the probe found: the mode to use, why, and the end-of-turn ids (empty in verify mode)."""

    mode: Literal["exact", "verify", "unreachable"]
    """``unreachable``: the engine did not answer (not up yet?): nothing is known about it."""
    reason: str
    eot_ids: frozenset[int] = frozenset()
    model: str = ""
    traits: EngineTraits | None = None
    """What exact mode needs to answer as the chat route (``None`` outside exact mode)."""


def _verify(reason: str) -> ExactProbe:
    return ExactProbe("verify", reason)


_UNREACHABLE = frozenset({502, 503, 504})
"""Statuses that say nothing about the engine's routes: the forwarder could not reach it, or it is not ready."""


async def _model(get: EngineGet) -> tuple[int, str | None]:
    status, answer = await get("/v1/models")
    try:
        return status, str(answer["data"][0]["id"]) if status == 200 else None
    except (KeyError, IndexError, TypeError):
        return status, None


def _closing(empty: list[int], filled: list[int]) -> list[int]:
    """What follows the content in an assistant turn: the common suffix of the empty and the filled turn."""
    size = 0
    while size < min(len(empty), len(filled)) and empty[-1 - size] == filled[-1 - size]:
        size += 1
    header = 0
    while header < min(len(empty), len(filled)) - size and empty[header] == filled[header]:
        header += 1
    return empty[header:]


async def probe_exact_prefix(post: EngineCall, get: EngineGet) -> ExactProbe:
    """Probe the engine (see the module docstring); never raises for an engine answer, only reports it."""
    status, model = await _model(get)
    if status in _UNREACHABLE:
        return ExactProbe("unreachable", f"GET /v1/models answered {status}")
    if model is None:
        return _verify(f"GET /v1/models answered {status} and named no model")
    user = {"role": "user", "content": "a"}

    async def render(messages: list[dict[str, Any]]) -> tuple[int, Any]:
        body = {"model": model, "messages": messages, "max_tokens": 1, "add_generation_prompt": False}
        return await post(RENDER_PATH, body)

    status, first = await render([user])
    if status == 403:
        return _verify("the engine's token-in/token-out routes are disabled (start vLLM with --enable-scale-out)")
    if status != 200:
        return _verify(f"POST {RENDER_PATH} answered {status} (vLLM >= 0.32 with --enable-scale-out needed)")
    status, _ = await post(DERENDER_PATH, {})
    if status in (403, 404, 405):
        return _verify(f"POST {DERENDER_PATH} answered {status}")
    turns = []
    for content in ("", "z"):
        status, answer = await render([user, {"role": "assistant", "content": content}])
        ids = answer.get("token_ids") if status == 200 and isinstance(answer, dict) else None
        if not isinstance(ids, list) or ids[: len(first["token_ids"])] != first["token_ids"]:
            return _verify("the template renders a user turn differently once an assistant turn follows")
        turns.append(ids[len(first["token_ids"]) :])
    closing = _closing(turns[0], turns[1])
    if not closing:
        return _verify("the template's assistant turn has no closing end-of-turn")
    eot_ids = frozenset({closing[0]})
    traits = await _traits(post, model, eot_ids)
    return ExactProbe("exact", f"{RENDER_PATH}, generate and derender answer", eot_ids, model, traits)


async def _single_id(post: EngineCall, model: str, text: str) -> int | None:
    status, answer = await post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
    tokens = answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
    return tokens[0] if isinstance(tokens, list) and len(tokens) == 1 and type(tokens[0]) is int else None


async def _traits(post: EngineCall, model: str, eot_ids: frozenset[int]) -> EngineTraits:
    """The chat route's answers exact mode reproduces (see the module docstring)."""
    eot = min(eot_ids)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 1,
        "temperature": 0.0,
        "logit_bias": {str(eot): 100.0},
    }
    status, answer = await post("/v1/chat/completions", body)
    answer = answer if status == 200 and isinstance(answer, dict) else {}
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    if not isinstance(message, dict):
        return EngineTraits(eot_ids)
    empty = {"content": message.get("content"), "reasoning": message.get("reasoning")}
    fingerprint = answer.get("system_fingerprint")
    usage = answer.get("usage")
    reasoning_usage = isinstance(usage, dict) and usage.get("completion_tokens_details") is not None
    think_ids = None
    if reasoning_usage:
        start, end = await _single_id(post, model, "<think>"), await _single_id(post, model, "</think>")
        think_ids = None if start is None or end is None else (start, end)
    return EngineTraits(
        eot_ids,
        system_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
        empty_message=empty,
        reasoning_usage=reasoning_usage,
        think_ids=think_ids,
    )
