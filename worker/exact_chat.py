"""One chat call in exact-prefix mode over vLLM 0.32's token-in/token-out routes (render, generate, derender).

The engine is reached through an :data:`EngineCall` (``(path, json) -> (status, parsed body)``): an HTTP client
for the forwarding proxy, a sub-request for the in-process middleware. The steps:

1. ``POST /v1/chat/completions/render`` renders the agent's request with the engine's own template into a
   generate request (templated ``token_ids`` and ``sampling_params``; log-probs always asked for);
2. for a continuation (the parent's exact sequence given), a second render of the messages through the last
   assistant one, without the generation prompt, counts the history's end-of-turn ids, and
   :func:`worker.exact_prefix.splice_exact_prompt` puts the parent's exact sequence in place of the rendered
   history;
3. ``POST /inference/v1/generate`` generates from those ids (not streamed: the stage needs the whole output);
4. ``POST /v1/chat/completions/derender`` turns the output back into a ``chat.completion`` with the engine's own
   reasoning and tool-call parsers (the agent's request goes along as ``chat_request``, so they see its tools).

The answer is a chat completion in vLLM's ``return_token_ids`` shape (top-level ``prompt_token_ids``: the spliced
prompt; ``choices[0].token_ids``; ``logprobs.content[*].logprob``), plus ``choices[0].weight_versions`` (the
generate route's spans), so the proxy's capture path stages it as it stages any vLLM answer. An engine error on
any step comes back as that step's status and body, unchanged (nothing was generated when render or generate
refused).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from worker.errors import EnginePayloadError, SpliceError
from worker.exact_prefix import count_end_of_turn, last_assistant_index, splice_exact_prompt

__all__ = (
    "DERENDER_PATH",
    "GENERATE_PATH",
    "RENDER_PATH",
    "EngineCall",
    "ExactAnswer",
    "Rendering",
    "exact_chat",
    "render_chat",
)

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"
EngineCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]
"""``(path, JSON body) -> (status, parsed JSON body)`` on the engine."""
_STREAM_FIELDS = ("stream", "stream_options")


@dataclass(frozen=True)
class ExactAnswer:
    """The outcome of one exact-prefix chat call."""

    status: int
    payload: Any
    """The chat completion (status 200) or the failing step's error body."""
    spliced: bool
    """Whether the prompt was spliced onto a parent's exact sequence."""


def _render_request(request: dict[str, Any]) -> dict[str, Any]:
    body = {key: value for key, value in request.items() if key not in _STREAM_FIELDS}
    if body.get("logprobs") in (None, False):
        body["logprobs"], body["top_logprobs"] = True, 0
    return body


def _checked_generation(answer: Any) -> dict[str, Any]:
    """The only choice of a generate answer, its ids and log-prob entries checked.

    :raises EnginePayloadError: not one choice, or ids and log-prob entries that disagree.
    """
    try:
        [choice] = answer["choices"]
        ids = choice["token_ids"]
        content = choice["logprobs"]["content"]
        entry_ids = [entry["token_id"] for entry in content]
    except (KeyError, TypeError, ValueError) as exc:
        raise EnginePayloadError(f"generate answer lacks choices[0] token_ids / logprobs.content: {exc!r}") from exc
    if not isinstance(ids, list) or not ids or entry_ids != ids:
        raise EnginePayloadError(
            "generate answer: no ids, or logprobs.content token ids differ from choices[0].token_ids"
        )
    if not isinstance(choice, dict):
        raise EnginePayloadError("generate answer: choices[0] is not an object")
    return choice


def _drop_stop_string(choice: dict[str, Any], stop_reason: Any, request: dict[str, Any]) -> None:
    """Cut the stop string off the text's tail, as vLLM's chat route does and its derender route does not.

    The generate route stops on the token that completes the string; the text ends with it (and whatever else
    that token spelled). The cut applies to the field holding the text's tail: the content, or the reasoning
    when the reply ended inside it. ``include_stop_str_in_output: true`` keeps it.
    """
    if not isinstance(stop_reason, str) or not stop_reason or request.get("include_stop_str_in_output") is True:
        return
    message = choice.get("message")
    if not isinstance(message, dict):
        return
    for field in ("content", "reasoning", "reasoning_content"):
        text = message.get(field)
        if isinstance(text, str) and text:
            cut = text.rfind(stop_reason)
            if cut >= 0:
                message[field] = text[:cut] if cut or field == "content" else None
            return


@dataclass(frozen=True)
class Rendering:
    """Steps 1 and 2: the engine's generate request for the request, and the history's end-of-turn count."""

    status: int
    answer: Any
    """The generate request (status 200), or the failing render's error body (nothing was generated)."""
    history_eot_count: int | None
    """End-of-turn ids in the rendering of the messages through the last assistant one (``None``: no such message)."""


async def render_chat(call: EngineCall, request: dict[str, Any], eot_ids: Collection[int]) -> Rendering:
    """Render *request*, and its history through the last assistant message (without the generation prompt), at once."""
    messages = request.get("messages") or []
    index = last_assistant_index(messages) if isinstance(messages, list) else None
    answers: dict[str, tuple[int, Any]] = {}

    async def render(name: str, body: dict[str, Any]) -> None:
        answers[name] = await call(RENDER_PATH, body)

    async with anyio.create_task_group() as group:
        group.start_soon(render, "full", _render_request(request))
        if index is not None:
            history = {**_render_request(request), "messages": messages[: index + 1], "add_generation_prompt": False}
            history.pop("continue_final_message", None)
            group.start_soon(render, "history", history)
    status, answer = answers["full"]
    if status != 200 or index is None:
        return Rendering(status, answer, None)
    history_status, history_answer = answers["history"]
    if history_status != 200:
        return Rendering(history_status, history_answer, None)
    return Rendering(200, answer, count_end_of_turn(history_answer["token_ids"], eot_ids))


async def exact_chat(
    call: EngineCall,
    request: dict[str, Any],
    *,
    parent_ids: Sequence[int] | None,
    eot_ids: Collection[int],
    rendering: Rendering | None = None,
) -> ExactAnswer:
    """Serve one chat request exactly (see the module docstring).

    :param parent_ids: the parent's exact staged sequence for a continuation; ``None`` for a root call.
    :param rendering: steps 1 and 2 when the caller already ran them (:func:`render_chat`).
    :raises worker.errors.SpliceError: the rendering cannot be spliced (the caller falls back to verify mode).
    :raises EnginePayloadError: an engine answer without the expected fields.
    """
    if rendering is None:
        rendering = await render_chat(call, request, eot_ids)
    if rendering.status != 200:
        return ExactAnswer(rendering.status, rendering.answer, spliced=False)
    rendered = rendering.answer
    prompt: list[int] = list(rendered["token_ids"])
    spliced = False
    if parent_ids:
        counted = rendering.history_eot_count
        if counted is None:
            raise SpliceError("a continuation without an assistant message: nothing to splice onto")
        prompt = splice_exact_prompt(prompt, history_eot_count=counted, eot_ids=eot_ids, parent_ids=parent_ids)
        spliced = True
    generate = {**rendered, "token_ids": prompt, "stream": False}
    status, generated = await call(GENERATE_PATH, generate)
    if status != 200:
        return ExactAnswer(status, generated, spliced=spliced)
    choice = _checked_generation(generated)
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    # Stopped on an end-of-turn id: vLLM's chat route never shows it in the text, but derender keeps special tokens
    # for its parsers, and a trailing "<|im_end|>" breaks them (a tool call stays text). Derender without it.
    eos_stop = choice.get("finish_reason") == "stop" and choice.get("stop_reason") is None and ids[-1] in eot_ids
    shown_ids = ids[:-1] if eos_stop and len(ids) > 1 else ids
    trimmed = {
        **choice,
        "token_ids": shown_ids,
        "logprobs": {"content": entries[: len(shown_ids)]},
        "weight_versions": None,
    }
    body = {
        "model": request.get("model"),
        "generate_response": {**generated, "choices": [trimmed]},
        "prompt_token_ids": prompt,
        "prompt_tokens": len(prompt),
        "chat_request": _render_request(request),
    }
    status, completion = await call(DERENDER_PATH, body)
    if status != 200:
        return ExactAnswer(status, completion, spliced=spliced)
    try:
        [out] = completion["choices"]
    except (KeyError, TypeError, ValueError) as exc:
        raise EnginePayloadError(f"derender answer lacks one choice: {exc!r}") from exc
    if eos_stop and len(ids) == 1:  # an empty reply: the chat route's empty message, whatever the parsers say
        out["message"] = {**out.get("message", {}), "content": "", "reasoning": None, "tool_calls": []}
    message = out.get("message")
    if isinstance(message, dict) and message.get("tool_calls") and out.get("finish_reason") == "stop":
        out["finish_reason"] = "tool_calls"  # as vLLM's chat route answers a parsed tool call
    # The engine's token strings where derender gave them; the trimmed end-of-turn as "token_id:<n>".
    shown = ((out.get("logprobs") or {}).get("content") or [])[: len(ids)]
    shown += [{"token": f"token_id:{token}", "top_logprobs": []} for token in ids[len(shown) :]]
    out["logprobs"] = {"content": [{**s, "logprob": e["logprob"]} for s, e in zip(shown, entries, strict=True)]}
    out["token_ids"] = ids
    _drop_stop_string(out, choice.get("stop_reason"), request)
    out["weight_versions"] = choice.get("weight_versions")
    if choice.get("routed_experts") is not None:
        out["routed_experts"] = choice["routed_experts"]
    completion["prompt_token_ids"] = prompt
    return ExactAnswer(200, completion, spliced=spliced)
