"""A multi-turn agent on the official ``openai`` client, for the exact-custody scenarios (plain, streaming, tools,
reasoning, stop strings, ``ignore_eos``, a forced empty reply, a 400 then a retry, two proxies).

Each turn sends the conversation so far, appends the assistant message as the agent received it (content, and the
tool calls it was given) and then an observation (a tool result, or a user message).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.helpers.proxy import client_for

__all__ = ("Turn", "run_scenario")

TurnOptions = Callable[[int], dict[str, Any]]


@dataclass
class Turn:
    """What the agent received on one turn."""

    response_id: str
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _create(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], options: dict[str, Any]) -> Turn:
    body = dict(options)
    extra = body.pop("extra_body", {})
    stream = body.pop("stream", False)
    create: Any = client.chat.completions.create  # options are per scenario: checked by the server, not here
    calls: list[dict[str, Any]] = []
    if not stream:
        completion: ChatCompletion = create(model=model, messages=messages, extra_body=extra, **body)
        message = completion.choices[0].message
        calls = [call.model_dump() for call in message.tool_calls or ()]
        reasoning = (message.model_extra or {}).get("reasoning")
        return Turn(completion.id, message.content, reasoning, calls)
    content: list[str] = []
    reasoning_parts: list[str] = []
    response_id = ""
    chunks: Iterator[ChatCompletionChunk] = create(
        model=model, messages=messages, extra_body=extra, stream=True, **body
    )
    for chunk in chunks:
        response_id = chunk.id
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            extra_delta = choice.delta.model_extra or {}
            if extra_delta.get("reasoning"):
                reasoning_parts.append(extra_delta["reasoning"])
            for call in choice.delta.tool_calls or ():
                calls.append(call.model_dump())
    return Turn(response_id, "".join(content), "".join(reasoning_parts) or None, calls)


def run_scenario(
    bases: list[str],
    rollout_id: str,
    model: str,
    turns: int,
    options: TurnOptions,
    *,
    observation: str = "tool",
    retry_400_on: int | None = None,
) -> tuple[list[dict[str, Any]], list[Turn]]:
    """Run one rollout; calls alternate over *bases*. Returns the final conversation and every turn received.

    :param options: per-turn keyword arguments of ``chat.completions.create`` (``stream``, ``stop``,
        ``extra_body``, ``tools``...).
    :param retry_400_on: on this turn, first send a request over the context (``max_tokens`` too large): the
        engine's 400 must reach the agent, which then retries with the turn's options.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"Task {rollout_id}."},
    ]
    received: list[Turn] = []
    for turn in range(turns):
        client = client_for(bases[turn % len(bases)], rollout_id)
        if turn == retry_400_on:
            try:
                _create(client, model, messages, {**options(turn), "max_tokens": 100_000})
            except openai.BadRequestError:
                pass
            else:
                raise AssertionError("an over-long request must be the engine's 400")
        got = _create(client, model, messages, options(turn))
        received.append(got)
        reply: dict[str, Any] = {"role": "assistant", "content": got.content or ""}
        if got.tool_calls:
            reply["tool_calls"] = got.tool_calls
        messages.append(reply)
        if observation == "tool":
            call_id = got.tool_calls[0]["id"] if got.tool_calls else f"call_{turn}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"result {turn}"})
        else:
            messages.append({"role": "user", "content": f"Go on ({turn})."})
    return messages[:-1], received
