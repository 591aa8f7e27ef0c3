"""One chat call in exact-prefix mode over vLLM 0.32's token-in/token-out routes, answered as its chat route answers.

The engine is reached through an :data:`EngineCall` (``(path, json) -> (status, parsed body)``): an HTTP client
for the forwarding proxy, a sub-request for the in-process middleware. The steps:

1. ``POST /v1/chat/completions/render`` renders the agent's request (as sent, so the engine validates it as its chat
   route does: ``logprobs: false`` with ``top_logprobs`` is its 400) into a generate request (templated ``token_ids``
   and resolved ``sampling_params``); for a continuation a second render of the messages through the last assistant
   one, without the generation prompt, counts the history's end-of-turn ids and fingerprints its context;
2. a continuation is spliced onto its parent's exact sequence (:func:`worker.proxy.exact.splice.splice_exact_prompt`) only
   when everything before the parent's reply renders as it did for the parent (:class:`ContextChangedError`
   otherwise: an edited system message, tools or template arguments make it no continuation of that parent);
3. ``POST /inference/v1/generate`` from those ids, with the sampling fields the proxy relies on set explicitly:
   vLLM serializes ``sampling_params`` without default-valued fields, so the agent's ``max_tokens: 16`` (vLLM's
   default) would vanish and generate would fill the context; ``max_tokens`` is the agent's value, or absent when
   the agent gave none (the engine then fills the context left by the actual, spliced prompt, as its chat route
   does for its prompt); ``logprobs`` is the agent's ``top_logprobs`` (0 when it did not ask: the stage needs them);
4. ``POST /v1/chat/completions/derender`` turns the output back into a chat completion with the engine's own
   reasoning and tool-call parsers, then :func:`_as_chat_route` gives it what vLLM's chat route answers for the
   same request and ids (see there). The log-prob entries go to derender (which resolves their token strings) only
   when the agent asked for log-probs; otherwise it is served none, and the stage reads the generate route's values.

The answer is a chat completion in vLLM's ``return_token_ids`` shape (top-level ``prompt_token_ids``: the spliced
prompt; ``choices[0].token_ids``; ``logprobs.content[*].logprob``), plus ``choices[0].weight_versions`` (the
generate route's spans), so the proxy's capture path stages it as it stages any vLLM answer. An engine error on
any step comes back as that step's status and body, unchanged (nothing was generated when render or generate
refused).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from worker.errors import ContextChangedError, EnginePayloadError, SpliceError
from worker.proxy.exact.splice import ScannedIds, last_assistant_index, splice_exact_prompt
from worker.proxy.routes import client_asked
from worker.sampling import sampling_from_engine

__all__ = (
    "DERENDER_PATH",
    "GENERATE_PATH",
    "RENDER_PATH",
    "EngineCall",
    "EngineTraits",
    "ExactAnswer",
    "Parent",
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
class EngineTraits:
    """What the start-up probe learned of the engine (:mod:`worker.proxy.exact.probe`)."""

    eot_ids: frozenset[int]
    """The template's end-of-turn id(s)."""
    system_fingerprint: str | None = None
    """What the chat route answers in ``system_fingerprint`` (derender answers ``null``)."""
    empty_message: dict[str, Any] = field(default_factory=lambda: {"content": "", "reasoning": None})
    """The chat route's ``content`` and ``reasoning`` for an empty reply (the end-of-turn alone): its parsers' answer
    for no text, which derender cannot give (it refuses an empty generation)."""
    reasoning_usage: bool = False
    """The chat route reports ``usage.completion_tokens_details`` (the engine has a reasoning parser)."""
    think_ids: tuple[int, int] | None = None
    """The reasoning parser's start and end ids (``<think>``, ``</think>``): reasoning tokens are counted between
    them, as vLLM's think-style parsers count them."""


@dataclass(frozen=True)
class Parent:
    """A continuation's parent: its exact staged sequence and the digest of the context it was rendered from."""

    ids: list[int]
    context: str | None
    """:func:`~worker.proxy.exact.splice.context_digest` of the parent's rendered prompt (from its extras); ``None``: it recorded none."""


@dataclass(frozen=True)
class ExactAnswer:
    """The outcome of one exact-prefix chat call."""

    status: int
    payload: Any
    """The chat completion (status 200) or the failing step's error body."""
    spliced: bool
    """Whether the prompt was spliced onto a parent's exact sequence."""
    sampling: dict[str, Any] | None = None
    """The sampling provenance of the generation (:mod:`worker.sampling`; ``None``: nothing generated)."""


def _render_request(request: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in request.items() if key not in _STREAM_FIELDS}


@dataclass(frozen=True)
class Rendering:
    """Step 1: the engine's generate request for the request, and what the history renders to."""

    status: int
    answer: Any
    """The generate request (status 200), or the failing render's error body (nothing was generated)."""
    history_eot_count: int | None
    """End-of-turn ids in the rendering of the messages through the last assistant one (``None``: no such message)."""
    history_context: str | None = None
    """:func:`~worker.proxy.exact.splice.context_digest` of that history before its last assistant turn: what the parent was rendered from,
    when nothing before the parent's reply changed (``None``: no assistant message)."""
    context: str | None = None
    """:func:`~worker.proxy.exact.splice.context_digest` of this request's own rendering (everything before its generation prompt), staged in
    its extras so that its continuations can check theirs."""
    scanned: ScannedIds | None = None
    """The ids of the request's rendering, proved, with their end-of-turn positions (status 200)."""


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
    if status != 200:
        return Rendering(status, answer, None)
    scanned = _scanned(answer, eot_ids)
    context = scanned.context_digest(len(scanned.eot_positions))
    if index is None:
        return Rendering(200, answer, None, None, context, scanned)
    history_status, history_answer = answers["history"]
    if history_status != 200:
        return Rendering(history_status, history_answer, None)
    history_scan = _scanned(history_answer, eot_ids)
    counted = len(history_scan.eot_positions)
    history_context = history_scan.context_digest(counted - 1) if counted else None
    return Rendering(200, answer, counted, history_context, context, scanned)


def _scanned(answer: Any, eot_ids: Collection[int]) -> ScannedIds:
    """The ids of a render answer, scanned once (:class:`ScannedIds`).

    :raises EnginePayloadError: no list of exact ints in ``[0, 2**64)``.
    """
    ids = answer.get("token_ids") if isinstance(answer, dict) else None
    if not isinstance(ids, list):
        raise EnginePayloadError("the render answer has no list of token ids")
    try:
        return ScannedIds.of(ids, eot_ids)
    except ValueError as exc:
        raise EnginePayloadError(f"the render answer's token ids are not exact ints in [0, 2**64): {exc}") from exc


def _generate_request(rendered: dict[str, Any], prompt: list[int], request: dict[str, Any]) -> dict[str, Any]:
    """The generate request: the rendered one on *prompt*, with ``max_tokens`` and ``logprobs`` set explicitly."""
    params = dict(rendered.get("sampling_params") or {})
    limit = request.get("max_completion_tokens")
    limit = request.get("max_tokens") if limit is None else limit
    if limit is None:
        params.pop("max_tokens", None)  # the engine fills the context left by *prompt*, as its chat route does
    else:
        params["max_tokens"] = limit
    params["logprobs"] = (request.get("top_logprobs") or 0) if request.get("logprobs") else 0
    return {**rendered, "token_ids": prompt, "sampling_params": params, "stream": False, "stream_options": None}


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


def _drop_stop_string(message: dict[str, Any], stop_reason: Any, request: dict[str, Any]) -> None:
    """Cut the stop string off the text's tail, as vLLM's chat route does and its derender route does not.

    The generate route stops on the token that completes the string; the text ends with it (and whatever else
    that token spelled). The cut applies to the field holding the text's tail: the content, or the reasoning
    when the reply ended inside it. ``include_stop_str_in_output: true`` keeps it.
    """
    if not isinstance(stop_reason, str) or not stop_reason or request.get("include_stop_str_in_output") is True:
        return
    for name in ("content", "reasoning"):
        text = message.get(name)
        if isinstance(text, str) and text:
            cut = text.rfind(stop_reason)
            if cut >= 0:
                message[name] = text[:cut] if cut or name == "content" else None
            return


def _hidden_last_token(
    choice: dict[str, Any], ids: list[int], eot_ids: Collection[int], request: dict[str, Any]
) -> bool:
    """Whether the chat route's text leaves out the last generated id: the end-of-turn that stopped the generation, or
    a ``stop_token_ids`` id (kept only with ``include_stop_str_in_output``)."""
    if choice.get("finish_reason") != "stop":
        return False
    reason = choice.get("stop_reason")
    if reason is None:
        return ids[-1] in eot_ids
    return type(reason) is int and reason == ids[-1] and request.get("include_stop_str_in_output") is not True


def _reasoning_tokens(ids: Sequence[int], think_ids: tuple[int, int] | None) -> int:
    """Generated ids between the reasoning markers (vLLM's think-style count: nested, unmatched ends ignored)."""
    if think_ids is None:
        return 0
    start, end = think_ids
    count = depth = 0
    for token in ids:
        if token == start:
            depth += 1
        elif token == end:
            depth = max(0, depth - 1)
        elif depth:
            count += 1
    return count


def _finish_reason(request: dict[str, Any], message: dict[str, Any], engine_reason: Any) -> Any:
    """vLLM's chat route: ``tool_calls`` when the parser found calls under an automatic tool choice, or when a
    ``required`` tool choice stopped; the engine's reason otherwise (a named tool choice stays ``stop``)."""
    choice = request.get("tool_choice")
    if message.get("tool_calls") and choice in (None, "auto"):
        return "tool_calls"
    if choice == "required" and engine_reason == "stop":
        return "tool_calls"
    return engine_reason or "stop"


def _logprob_entries(
    shown: list[dict[str, Any]], entries: list[dict[str, Any]], request: dict[str, Any]
) -> list[dict[str, Any]]:
    """The chat route's ``logprobs.content``: derender's token strings, the generate route's values, and token strings
    spelled ``token_id:<n>`` when the agent asked ``return_tokens_as_token_ids``."""
    as_ids = request.get("return_tokens_as_token_ids") is True
    top = request.get("top_logprobs") or 0
    out = []
    for text, entry in zip(shown, entries, strict=True):
        item = {**text, "logprob": text.get("logprob", entry["logprob"])}
        item["top_logprobs"] = (item.get("top_logprobs") or [])[:top]  # the engine also lists the sampled token
        if as_ids:
            item["token"] = f"token_id:{entry['token_id']}"
            tops = entry.get("top_logprobs") or []
            item["top_logprobs"] = [  # the chat route spells the candidates' bytes from their placeholders too
                {**top_text, "token": (spelled := f"token_id:{top['token_id']}"), "bytes": list(spelled.encode())}
                for top_text, top in zip(item.get("top_logprobs") or [], tops, strict=False)
            ]
        out.append(item)
    return out


def _as_chat_route(
    request: dict[str, Any],
    rendered: dict[str, Any],
    prompt: list[int],
    generated: dict[str, Any],
    derendered: dict[str, Any],
    traits: EngineTraits,
    *,
    empty: bool,
    asked_logprobs: bool,
) -> dict[str, Any]:
    """The chat completion vLLM's chat route answers for *request* with the ids *generated* on *prompt*.

    Derender gives the message (its parsers), the log-prob token strings and most of the shape; the chat route
    differs from it in: the completion id (``chatcmpl-``, render's request id), ``system_fingerprint``, usage
    (the stopping end-of-turn counted; reasoning tokens), the stop string cut from the text, ``finish_reason``
    (``tool_calls``), an empty reply's message, and the end-of-turn's log-prob entry (derender never saw the
    end-of-turn as an id: see :func:`exact_chat`).
    """
    choice = generated["choices"][0]
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    completion = derendered
    message = dict(completion["choices"][0].get("message") or {})
    if empty:  # the chat route's parsers on no text (learned by the probe); derender saw the end-of-turn as text
        message.update({"content": "", "reasoning": None, **traits.empty_message})
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
    else:
        _drop_stop_string(message, choice.get("stop_reason"), request)
    choice_tool = request.get("tool_choice")
    if isinstance(choice_tool, dict) or choice_tool == "required":
        message["content"] = message.get("content") or ""
    [out] = completion["choices"]
    if asked_logprobs:  # derender resolved the entries' token strings
        shown = list(((out.get("logprobs") or {}).get("content")) or [])
        shown += [{"token": f"token_id:{token}", "bytes": None, "top_logprobs": []} for token in ids[len(shown) :]]
        content = _logprob_entries(shown, entries, request)
    else:
        # Derender resolved none (see exact_chat): generate's own entries, whose log-probs the stage reads (its ids are
        # token_ids; the entries spell no token strings to check); never served, since the agent did not ask for them.
        content = entries
    reasoning = _reasoning_tokens(ids, traits.think_ids)
    completion.update(
        id=rendered.get("request_id") or completion.get("id"),
        system_fingerprint=traits.system_fingerprint,
        prompt_token_ids=prompt,
        usage={
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if traits.reasoning_usage else None,
        },
    )
    out.update(
        message=message,
        logprobs={"content": content},
        finish_reason=_finish_reason(request, message, choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        token_ids=ids,
        routed_experts=choice.get("routed_experts"),
        weight_versions=choice.get("weight_versions"),
    )
    return completion


async def exact_chat(
    call: EngineCall,
    request: dict[str, Any],
    *,
    parent: Parent | None,
    traits: EngineTraits,
    rendering: Rendering | None = None,
) -> ExactAnswer:
    """Serve one chat request exactly (see the module docstring).

    :param parent: the parent of a continuation; ``None`` for a root call (or one served as a root).
    :param rendering: step 1 when the caller already ran it (:func:`render_chat`).
    :raises ContextChangedError: the context before the parent's reply renders differently than it did for the parent.
    :raises worker.errors.SpliceError: the rendering cannot be spliced (the caller falls back to verify mode).
    :raises EnginePayloadError: an engine answer without the expected fields.
    """
    eot_ids = traits.eot_ids
    if rendering is None:
        rendering = await render_chat(call, request, eot_ids)
    if rendering.status != 200:
        return ExactAnswer(rendering.status, rendering.answer, spliced=False)
    rendered = rendering.answer
    scanned = rendering.scanned or _scanned(rendered, eot_ids)
    prompt = scanned.ids
    spliced = False
    if parent is not None and parent.ids:
        counted = rendering.history_eot_count
        if counted is None:
            raise SpliceError("a continuation without an assistant message: nothing to splice onto")
        if parent.context is None:
            raise SpliceError("the parent recorded no rendered context (staged in verify mode): cannot prove it")
        if rendering.history_context != parent.context:
            raise ContextChangedError(
                "the conversation before the parent's reply renders differently than it did for the parent (an "
                "edited system or developer message, earlier turn, tools or template arguments)"
            )
        prompt = splice_exact_prompt(
            prompt,
            history_eot_count=counted,
            eot_ids=eot_ids,
            parent_ids=parent.ids,
            eot_positions=scanned.eot_positions,
        )
        spliced = True
    generate = _generate_request(rendered, prompt, request)
    sampling = sampling_from_engine(generate["sampling_params"], request)
    status, generated = await call(GENERATE_PATH, generate)
    if status != 200:
        return ExactAnswer(status, generated, spliced=spliced)
    choice = _checked_generation(generated)
    ids = choice["token_ids"]
    # Stopped on an end-of-turn id, or on a stop token id: vLLM's chat route never shows that token in the text (its
    # parsers never see it), but derender keeps special tokens for its parsers. Derender the ids without it, with every
    # log-prob entry (derender resolves token strings from the entries, independently of the ids). An empty reply (that
    # token alone): derender refuses an empty generation, so it derenders the token for its log-prob entry only; the
    # message is the chat route's for no text, which the probe learned.
    hidden = _hidden_last_token(choice, ids, eot_ids, request)
    empty = hidden and len(ids) == 1
    shown = {**choice, "token_ids": ids[:-1] if hidden and not empty else ids, "weight_versions": None}
    asked_logprobs = client_asked(request).logprobs
    if not asked_logprobs:  # nothing to resolve: the agent is served no entries, the stage reads generate's
        shown["logprobs"] = None
    body = {
        "model": request.get("model"),
        "generate_response": {**generated, "choices": [shown]},
        "prompt_token_ids": prompt,
        "prompt_tokens": len(prompt),
        "chat_request": _render_request(request),
    }
    status, derendered = await call(DERENDER_PATH, body)
    if status != 200:
        return ExactAnswer(status, derendered, spliced=spliced)
    try:
        [_] = derendered["choices"]
    except (KeyError, TypeError, ValueError) as exc:
        raise EnginePayloadError(f"derender answer lacks one choice: {exc!r}") from exc
    completion = _as_chat_route(
        request, rendered, prompt, generated, derendered, traits, empty=empty, asked_logprobs=asked_logprobs
    )
    return ExactAnswer(200, completion, spliced=spliced, sampling=sampling)
