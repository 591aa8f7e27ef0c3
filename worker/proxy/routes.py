"""What the capture proxy reads from and writes to OpenAI-compatible requests and responses.

* the rollout identity: the route prefix ``/r/{rollout_id}`` or the header ``X-Staging-Rollout-Id`` (and a
  rollout's chain-policy opt-in, ``X-Staging-Chains``);
* the request items the gate resolves a parent from (chat ``messages``, Responses ``input``, a completion prompt);
* the request fields the upstream needs to return exact ids and log-probs (vLLM 0.10.2+ ``return_token_ids``,
  ``logprobs`` with ``return_tokens_as_token_ids``; ``required_prefix_token_ids`` for a ``nemo-rl`` upstream);
* the token fields stripped from the response before the agent sees it (those the client did not ask for).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from sink.contract.chains import ChainPolicy
from sink.keys import validate_rollout_id
from sink.settings import UpstreamKind
from worker.adapters import CaptureAdapter
from worker.errors import EnginePayloadError
from worker.openai_adapters import NemoGymResponsesAdapter, OpenAIChatAdapter, VLLMCompletionAdapter

__all__ = (
    "CAPTURE_ROUTES",
    "CHAINS_HEADER",
    "PASSTHROUGH_POSTS",
    "ROLLOUT_HEADER",
    "ClientAsked",
    "RouteKind",
    "Target",
    "adapter_for",
    "canonical_path",
    "chains_of",
    "client_asked",
    "disguised_capture_route",
    "parse_target",
    "request_items",
    "response_items",
    "served_items",
    "strip_token_fields",
    "upstream_request",
)

RouteKind = Literal["chat", "completions", "responses"]
CAPTURE_ROUTES: dict[str, RouteKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
PASSTHROUGH_POSTS = frozenset({"/tokenize", "/detokenize"})
"""The POST routes besides the captured ones that a rollout may reach under ``fail_closed``: they generate nothing.
Any other rollout-tagged POST (``/inference/v1/generate``, render routes, audio, ``/v1/messages``...) is refused."""
ROLLOUT_HEADER = b"x-staging-rollout-id"
"""Request header naming the rollout (lower-case, as ASGI delivers it)."""
CHAINS_HEADER = b"x-staging-chains"
"""Request header opting one rollout into a multi-chain policy (``roots`` or ``branches``, contract §14.1)."""

_ROUTE = re.compile(r"^/r/([^/]+)(/.*)?$")
_MESSAGE_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
_ADAPTERS: dict[RouteKind, CaptureAdapter] = {
    "chat": OpenAIChatAdapter(),
    "completions": VLLMCompletionAdapter(),
    "responses": NemoGymResponsesAdapter(),
}


@dataclass(frozen=True)
class Target:
    """Where a request goes: its rollout (if any), the upstream path, and whether it is ``/r/{id}/finished``."""

    rollout_id: str | None
    path: str
    finished: bool = False


def parse_target(path: str, rollout_header: str | None) -> Target:
    """The rollout and upstream path of a request (the route prefix wins over the header).

    :raises ValueError: an invalid rollout id (contract §6.8).
    """
    match = _ROUTE.match(path)
    if match is None:
        if rollout_header is None:
            return Target(None, path)
        return Target(validate_rollout_id(rollout_header), path)
    rollout_id = validate_rollout_id(match.group(1))
    rest = match.group(2) or "/"
    return Target(rollout_id, rest, finished=rest == "/finished")


def chains_of(scope: Mapping[str, Any]) -> dict[str, ChainPolicy]:
    """The ``admit()`` option of a request that opts its rollout into a chain policy (header
    ``X-Staging-Chains``): ``{"chain_policy": ...}``, or ``{}`` without the header (the gate's default).

    :raises ValueError: the header names no chain policy.
    """
    for name, value in scope.get("headers", ()):
        if name == CHAINS_HEADER:
            text = value.decode("latin-1").strip().lower()
            try:
                return {"chain_policy": ChainPolicy(text)}
            except ValueError:
                raise ValueError(f"X-Staging-Chains must be single, roots or branches, not {text!r}") from None
    return {}


def canonical_path(path: str) -> str:
    """*path* (percent-decoded, as the ASGI server delivers it) without empty, ``.`` and ``..`` segments nor a
    trailing slash: the path the forwarding client would send anyway (httpx removes dot segments and merges a
    leading ``//``), so the proxy routes exactly what the engine will see."""
    segments: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    return "/" + "/".join(segments)


def disguised_capture_route(path: str) -> bool:
    """Whether *path* (canonical, not a capture route) becomes one once its remaining percent-escapes are decoded
    (``%252E`` arrives as ``%2E``; a client or engine that decodes again would reach the captured route)."""
    for _ in range(4):
        decoded = canonical_path(unquote(path))
        if decoded == path:
            return False
        if decoded in CAPTURE_ROUTES:
            return True
        path = decoded
    return False


def adapter_for(route: RouteKind) -> CaptureAdapter:
    """The payload adapter of *route*."""
    return _ADAPTERS[route]


@dataclass(frozen=True)
class ClientAsked:
    """The token fields the client itself requested (these are not stripped)."""

    token_ids: bool
    logprobs: bool


def _items(value: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise EnginePayloadError(f"{what} must be a list of JSON objects")
    return value


def request_items(route: RouteKind, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation items the gate fingerprints (a completion prompt is one user item: always a root).

    :raises EnginePayloadError: the request has no usable messages / input / prompt.
    """
    if route == "chat":
        return _items(request.get("messages"), "messages")
    if route == "responses":
        raw = request.get("input")
        return [{"role": "user", "content": raw}] if isinstance(raw, str) else _items(raw, "input")
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        return [{"role": "user", "content": "token_ids:" + ",".join(map(str, prompt))}]
    raise EnginePayloadError("prompt must be a string or a list of token ids")


def client_asked(request: dict[str, Any]) -> ClientAsked:
    """The token fields the client of *request* asked for itself."""
    return ClientAsked(
        token_ids=request.get("return_token_ids") is True,
        logprobs=request.get("logprobs") not in (None, False),
    )


def upstream_request(
    route: RouteKind, request: dict[str, Any], kind: UpstreamKind, prefix_ids: list[int]
) -> tuple[dict[str, Any], ClientAsked]:
    """The request sent upstream (exact ids and log-probs asked for, never streamed) and what the client asked."""
    asked = client_asked(request)
    body = dict(request)
    body.pop("stream", None)
    body.pop("stream_options", None)
    body["return_token_ids"] = True
    if not asked.logprobs:
        if route == "chat":
            body["logprobs"], body["top_logprobs"] = True, 0
        elif route == "completions":
            body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    if kind == "nemo-rl" and prefix_ids:
        body = adapter_for(route).enter_prefix(body, prefix_ids)
    return body, asked


def _nulled(mapping: dict[str, Any], *names: str) -> bool:
    """Each of *names* that *mapping* holds a value for set to ``None`` (vLLM's own answer when the fields were not
    asked for); whether one held a value."""
    held = [name for name in names if mapping.get(name) is not None]
    for name in held:
        mapping[name] = None
    return bool(held)


def _removed(mapping: dict[str, Any], *names: str) -> bool:
    """Each of *names* removed from *mapping*; whether one was there."""
    present = [name for name in names if name in mapping]
    for name in present:
        del mapping[name]
    return bool(present)


def strip_token_fields(route: RouteKind, payload: dict[str, Any], asked: ClientAsked) -> bool:
    """Strip from *payload* (in place) the token fields the client did not ask for: vLLM's keys hold ``None`` as
    vLLM answers without ``return_token_ids``; NeMo Gym's message-level fields are removed. Returns whether anything
    changed: ``False`` when *payload* is still the engine's answer as it came (the client asked for every token
    field it holds), which can then be served as the engine's own bytes."""
    changed = _removed(payload, "ng_commit_coords")
    if route == "responses":
        for item in payload.get("output") or ():
            if isinstance(item, dict) and not asked.token_ids:
                changed |= _removed(item, *_MESSAGE_TOKEN_FIELDS)
        return changed
    if not asked.token_ids:
        changed |= _nulled(payload, "prompt_token_ids")
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if not asked.token_ids:
            changed |= _nulled(choice, "token_ids", "prompt_token_ids", "routed_experts")
            message = choice.get("message")
            if isinstance(message, dict):
                changed |= _removed(message, *_MESSAGE_TOKEN_FIELDS)
        if not asked.logprobs:
            changed |= _nulled(choice, "logprobs")
    return changed


def served_items(route: RouteKind, payload: dict[str, Any], asked: ClientAsked) -> list[dict[str, Any]]:
    """:func:`response_items` of *payload* once :func:`strip_token_fields` (*asked*) has run, *payload* unchanged: the
    items of the response as it will be served, known before the token fields are stripped."""
    items = response_items(route, payload)
    if route == "responses" and not asked.token_ids:
        items = [{key: value for key, value in item.items() if key not in _MESSAGE_TOKEN_FIELDS} for item in items]
    return items


def response_items(route: RouteKind, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The served items the gate fingerprints (the stripped assistant message or output items)."""
    if route == "responses":
        return [item for item in payload.get("output") or () if isinstance(item, dict)]
    choices = payload.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    if route == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            return []
        return [{key: value for key, value in message.items() if key not in _MESSAGE_TOKEN_FIELDS}]
    return [{"role": "assistant", "content": choice.get("text") or ""}]
