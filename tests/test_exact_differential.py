"""Exact-prefix mode answers as the engine's own chat route does, and every option reaches the engine.

For each option an agent may set on a chat completion, the same first turn and the same second turn are sent straight
to the engine's ``/v1/chat/completions`` and through the capture proxy (exact-prefix mode: render, generate from
token ids, derender), with the official ``openai`` client and greedy decoding or a fixed seed, so both are
deterministic. The answers must be identical field by field (ids and timestamps aside; tool-call ids are random on
both sides). A logging hop between the proxy and the engine shows what the proxy asked the generate route for: every
option reaches it as the agent meant it (``max_tokens`` explicitly, whatever its value).

The second turn: where the spliced prompt equals what the chat route renders from the conversation (plain ChatML,
tools, logprobs...), the answers must be identical. Where it differs by design, the case names why
(:attr:`Case.exact_differs`: a stop string or ``ignore_eos`` leaves ids the text does not show, a template drops earlier
reasoning) and the proxy's answer must carry the same fields, with the engine's generation from the spliced prompt.

Both tiers: the simulated engine (fast tier) and the real vLLM 0.32 (``vllm`` tier, the three tiny models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.logging_hop import LoggingHop, running_hop
from tests.helpers.proxy import client_for, close_clients, proxy_config
from tests.helpers.tier_engine import TierEngine, tier_engine
from tests.helpers.tls import tls
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are terse."}


Options = Callable[[TierEngine], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One option set, sent on both turns."""

    variant: str
    options: Options
    exact_differs: str = ""
    """Why the second turn's exact prompt differs from the chat route's rendering ("" when it does not)."""
    error: bool = False
    """The first turn is refused (400): both sides must refuse it the same way."""


def greedy(engine: TierEngine, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "logit_bias": engine.bias(), **extra}


def _eot(engine: TierEngine, value: float) -> dict[str, float]:
    return engine.bias(**{str(engine.eot): value})


_TOOL_CALL_TEXT = "the template renders a tool call otherwise than the model wrote it"

CASES: dict[str, Case] = {
    "max-tokens-16": Case("chatml", lambda e: greedy(e, max_tokens=16)),
    "max-tokens-5": Case("chatml", lambda e: greedy(e, max_tokens=5)),
    "max-tokens-40": Case("chatml", lambda e: greedy(e, max_tokens=40)),
    "max-completion-tokens-16": Case("chatml", lambda e: greedy(e, max_completion_tokens=16)),
    "end-of-turn": Case("chatml", lambda e: {"temperature": 0.0, "max_tokens": 30, "logit_bias": _eot(e, 6.0)}),
    "empty-reply": Case("chatml", lambda e: {"temperature": 0.0, "max_tokens": 8, "logit_bias": _eot(e, 100.0)}),
    "stop": Case(
        "chatml", lambda e: greedy(e, max_tokens=30, stop=["a", "e", "o"]), exact_differs="the stop string's ids"
    ),
    "include-stop-str": Case(
        "chatml", lambda e: greedy(e, max_tokens=30, stop=["a", "e", "o"], include_stop_str_in_output=True)
    ),
    "stop-token-ids": Case(
        "chatml",
        lambda e: greedy(e, max_tokens=30, stop_token_ids=[e.letters["a"]]),
        exact_differs="the stop token's id, which the text leaves out",
    ),
    "min-tokens": Case("chatml", lambda e: {"temperature": 0.0, "max_tokens": 12, "min_tokens": 6, "logit_bias": _eot(e, 8.0)}),
    "ignore-eos": Case(
        "chatml",
        lambda e: {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, "logit_bias": _eot(e, 5.0)},
        exact_differs="end-of-turn ids inside the generation",
    ),
    "seed": Case("chatml", lambda e: {"temperature": 1.0, "seed": 7, "max_tokens": 16, "logit_bias": e.bias()}),
    "top-p-top-k": Case(
        "chatml", lambda e: {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3, "max_tokens": 16, "logit_bias": e.bias()}
    ),
    "penalties": Case(
        "chatml",
        lambda e: greedy(e, max_tokens=16, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    ),
    "logprobs": Case("chatml", lambda e: greedy(e, max_tokens=8, logprobs=True, top_logprobs=3)),
    "logprobs-eot": Case(
        "chatml", lambda e: {"temperature": 0.0, "max_tokens": 20, "logprobs": True, "top_logprobs": 2, "logit_bias": _eot(e, 6.0)}
    ),
    "top-logprobs-without-logprobs": Case("chatml", lambda e: greedy(e, max_tokens=4, logprobs=False, top_logprobs=3), error=True),
    "token-ids": Case("chatml", lambda e: greedy(e, max_tokens=8, return_token_ids=True)),
    "tokens-as-ids": Case(
        "chatml", lambda e: greedy(e, max_tokens=8, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    ),
    "json-object": Case("chatml", lambda e: greedy(e, max_tokens=12, response_format={"type": "json_object"})),
    "stream": Case("chatml", lambda e: greedy(e, max_tokens=12, stream=True, stream_options={"include_usage": True})),
    "stream-logprobs": Case("chatml", lambda e: greedy(e, max_tokens=6, stream=True, logprobs=True)),
    "reasoning": Case(
        "reasoning",
        lambda e: {"temperature": 0.0, "max_tokens": 16, "logit_bias": e.bias(**({str(e.think_end): 3.0} if e.think_end else {}))},
        exact_differs="the template drops earlier reasoning",
    ),
    "reasoning-only": Case("reasoning", lambda e: greedy(e, max_tokens=6), exact_differs="the template drops earlier reasoning"),
    "reasoning-empty": Case(
        "reasoning",
        lambda e: {"temperature": 0.0, "max_tokens": 6, "logit_bias": _eot(e, 100.0)},
        exact_differs="the generation prompt opens <think>, which the template leaves out of earlier turns",
    ),
    "reasoning-stream": Case(
        "reasoning",
        lambda e: {
            "temperature": 0.0,
            "max_tokens": 16,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": e.bias(**({str(e.think_end): 3.0} if e.think_end else {})),
        },
        exact_differs="the template drops earlier reasoning",
    ),
    "tools-auto": Case(
        "tools",
        lambda e: greedy(e, max_tokens=24, tools=TOOLS, tool_choice="auto", structured_outputs={"choice": ["[lookup(q='x')]"]}),
        exact_differs=_TOOL_CALL_TEXT,
    ),
    "tools-auto-text": Case("tools", lambda e: greedy(e, max_tokens=12, tools=TOOLS)),
    "tools-named": Case(
        "tools",
        lambda e: greedy(e, max_tokens=40, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}}),
        exact_differs=_TOOL_CALL_TEXT,
    ),
    "tools-stream": Case(
        "tools",
        lambda e: greedy(e, max_tokens=24, tools=TOOLS, stream=True, structured_outputs={"choice": ["[lookup(q='y')]"]}),
        exact_differs=_TOOL_CALL_TEXT,
    ),
}
ENGINES = ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)]
_VOLATILE = ("id", "created")


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _normalized(value: Any) -> Any:
    """*value* without what differs on every call (ids, timestamps, tool-call ids)."""
    if isinstance(value, dict):
        out = {key: _normalized(item) for key, item in value.items() if key not in _VOLATILE}
        if "function" in value and "type" in value and "id" in value:  # a tool call: its id is random on both sides
            out["id"] = "<tool call id>"
        return out
    if isinstance(value, list):
        return [_normalized(item) for item in value]
    return value


def differences(direct: Any, proxied: Any, path: str = "") -> list[str]:
    """Where *proxied* differs from *direct* (paths and both values)."""
    if isinstance(direct, dict) and isinstance(proxied, dict):
        out = []
        for key in sorted(set(direct) | set(proxied)):
            if key not in proxied:
                out.append(f"{path}.{key}: missing through the proxy (direct: {direct[key]!r:.80})")
            elif key not in direct:
                out.append(f"{path}.{key}: only through the proxy ({proxied[key]!r:.80})")
            else:
                out += differences(direct[key], proxied[key], f"{path}.{key}")
        return out
    if isinstance(direct, list) and isinstance(proxied, list) and len(direct) == len(proxied):
        return [d for i, (a, b) in enumerate(zip(direct, proxied, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if direct == proxied else [f"{path}: direct {direct!r:.120} != proxied {proxied!r:.120}"]


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``create()`` keywords the ``openai`` client types, and the rest (sent as ``extra_body``)."""
    typed = {
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs",
        "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice", "stream",
        "stream_options",
    }  # fmt: skip
    return {k: v for k, v in options.items() if k in typed}, {k: v for k, v in options.items() if k not in typed}


@dataclass
class Answer:
    """One answer as the agent received it: the JSON of the completion (or of every chunk), or the error."""

    body: Any
    status: int = 200

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation (content and tool calls)."""
        if isinstance(self.body, list):  # a stream: assemble the deltas as an agent does
            content = ""
            calls: list[dict[str, Any]] = []
            for chunk in self.body:
                for choice in chunk["choices"]:
                    content += choice["delta"].get("content") or ""
                    calls += choice["delta"].get("tool_calls") or []
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            return reply
        message = self.body["choices"][0]["message"]
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        return reply


def ask(base: str, model: str, messages: list[dict[str, Any]], options: dict[str, Any], rollout: str | None) -> Answer:
    """Send one chat completion with the official client; the answer's JSON as received."""
    client = client_for(base, rollout)
    typed, extra = _split(options)
    create: Any = client.chat.completions.create
    try:
        result = create(model=model, messages=messages, extra_body=extra, **typed)
    except openai.APIStatusError as exc:
        return Answer(exc.response.json(), exc.status_code)
    if typed.get("stream"):
        return Answer([chunk.model_dump(mode="json", exclude_unset=True) for chunk in result])
    return Answer(result.model_dump(mode="json", exclude_unset=True))


def _generate_requests(hop: LoggingHop) -> list[dict[str, Any]]:
    return [exchange.request_json() for exchange in hop.on("/inference/v1/generate")]


def _rendered(engine: TierEngine, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
    body = {k: v for k, v in options.items() if k not in ("stream", "stream_options")}
    answer = httpx.post(
        f"{engine.url}/v1/chat/completions/render",
        json={"model": engine.model, "messages": messages, **body},
        timeout=60,
        verify=tls(),
    )
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["token_ids"]
    return ids


def assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat stream as an agent assembles it: the texts, tool calls (by index) and log-probs concatenated, the
    ending choice's reasons and ids, the usage, the fingerprint; and the keys of its first, ending and usage chunks
    (vLLM splits the text over as many chunks as engine steps: only what they add up to is compared)."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "logprobs": [], "token_ids": [], "tool_calls": {}}
    for chunk in chunks:
        for key in ("model", "object", "system_fingerprint", "usage"):
            if chunk.get(key) is not None:
                out[key] = chunk[key]
        for choice in chunk.get("choices") or ():
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                merged = out["tool_calls"].setdefault(call["index"], {"name": "", "arguments": "", "type": None})
                merged["type"] = call.get("type") or merged["type"]
                merged["name"] += (call.get("function") or {}).get("name") or ""
                merged["arguments"] += (call.get("function") or {}).get("arguments") or ""
            out["logprobs"] += (choice.get("logprobs") or {}).get("content") or []
            out["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                out["finish_reason"], out["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
                out["ending keys"] = sorted(chunk)
    out["first keys"] = sorted(chunks[0])
    out["first choice"] = _normalized(chunks[0]["choices"][0])
    out["prompt_token_ids"] = chunks[0].get("prompt_token_ids")
    out["usage keys"] = sorted(chunks[-1]) if not chunks[-1]["choices"] else None
    return out


def _assert_same(direct: Answer, proxied: Answer, what: str) -> None:
    assert proxied.status == direct.status, f"{what}: status {proxied.status} != {direct.status}: {proxied.body}"
    if isinstance(direct.body, list):
        assert isinstance(proxied.body, list), f"{what}: not a stream through the proxy"
        found = differences(assembled(direct.body), assembled(proxied.body))
    else:
        found = differences(_normalized(direct.body), _normalized(proxied.body))
    assert not found, f"{what}: the proxy's answer differs from the chat route's:\n" + "\n".join(found)


def _assert_same_fields(direct: Answer, proxied: Answer, what: str) -> None:
    """The same shape (keys at every level, value types) where the values may differ by design."""

    def shape(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: shape(item) for key, item in value.items() if key not in _VOLATILE}
        if isinstance(value, list):
            return [shape(value[0])] if value else []
        return type(value).__name__

    assert proxied.status == direct.status == 200, what
    if isinstance(direct.body, list):
        assert shape(direct.body[-1]) == shape(proxied.body[-1]), what
        return
    assert shape(direct.body) == shape(proxied.body) or not direct.body["choices"][0]["message"].get("tool_calls"), what


def _check_sampling_params(case: Case, engine: TierEngine, options: dict[str, Any], hop: LoggingHop) -> None:
    """Every generate request carried the agent's ``max_tokens`` explicitly and its log-prob count; every derender
    request carried log-prob entries exactly when the agent asked for log-probs."""
    limit = options.get("max_completion_tokens", options.get("max_tokens"))
    for generate in _generate_requests(hop):
        params = generate["sampling_params"]
        assert params.get("max_tokens") == limit, f"generate got max_tokens {params.get('max_tokens')}, asked {limit}"
        wanted = options.get("top_logprobs") or 0 if options.get("logprobs") else 0
        assert params.get("logprobs") == wanted
    asked = options.get("logprobs") not in (None, False)
    derenders = [exchange.request_json() for exchange in hop.on("/v1/chat/completions/derender")]
    for derender in (body for body in derenders if body):  # the start-up probe posts an empty body
        # The log-prob entries go back to derender only for an agent that asked for them (their token strings are
        # what it resolves); the stage reads the generate route's values either way.
        [choice] = derender["generate_response"]["choices"]
        assert (choice.get("logprobs") is not None) == asked, f"derender got log-prob entries: {asked=}"


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_exact_mode_answers_as_the_chat_route(
    name: str, kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    case = CASES[name]
    with ExitStack() as stack:
        engine = tier_engine(kind, case.variant, request, stack)
        hop, hop_url = stack.enter_context(running_hop(engine.url))
        proxy = stack.enter_context(running_server(ProxyApp(proxy_config(scenario_redis_url, hop_url))))
        options = case.options(engine)
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Go."}]
        rollout = f"diff-{name}-{kind}"
        first_direct = ask(engine.url, engine.model, messages, options, None)
        first = ask(proxy, engine.model, messages, options, rollout)
        _assert_same(first_direct, first, "turn 1")
        if case.error:
            assert not _generate_requests(hop), "a refused request must generate nothing"
            return
        _check_sampling_params(case, engine, options, hop)
        hop.clear()
        messages = [*messages, first.message(), {"role": "user", "content": "More."}]
        second_direct = ask(engine.url, engine.model, messages, options, None)
        second = ask(proxy, engine.model, messages, options, rollout)
        [generate] = _generate_requests(hop)
        spliced = generate["token_ids"]
        if spliced == _rendered(engine, messages, options):
            assert not case.exact_differs or kind == "simulated", f"{name}: expected the prompts to differ"
            _assert_same(second_direct, second, "turn 2")
        else:
            assert case.exact_differs, f"{name}: the exact prompt differs from the chat route's, with no reason given"
            _assert_same_fields(second_direct, second, "turn 2")
        _check_sampling_params(case, engine, options, hop)
