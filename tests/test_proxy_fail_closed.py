"""Capture-proxy hardening against real servers: fail-closed refuses what it cannot capture (bodies only a lenient
JSON parser reads, captured routes in any spelling), fail-open never serves token ids of an engine body it cannot
parse, engine payloads that contradict themselves fail the capture, and groups go through ``/r/{id}/finished``."""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import openai
import pytest

from sink.contract.records import UNCOMMITTED_CALL_REASON, WORKER_CAPTURE_FAILED_REASON, CallRecord
from sink.ledger.gate import CaptureGate
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.e2e import running_assembler
from tests.helpers.proxy import SYSTEM, client_for, close_clients, manifest, proxy_config, run_agent, unset
from worker.asgi import Receive, Scope, Send, read_body, send_body
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

MESSAGES: list[Any] = [SYSTEM, {"role": "user", "content": "go"}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _completion(*, token_strings: list[str] | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    ids = [5, 6] if token_ids is None else token_ids
    strings = [f"token_id:{i}" for i in ids] if token_strings is None else token_strings
    return {
        "id": "chatcmpl-fixed",
        "object": "chat.completion",
        "created": 0,
        "model": "simulated",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "fine"},
                "logprobs": {"content": [{"token": s, "logprob": -0.5, "top_logprobs": []} for s in strings]},
                "token_ids": ids,
                "finish_reason": "stop",
            }
        ],
    }


class LenientUpstream:
    """An engine whose JSON parser is Python's (as vLLM's FastAPI server): NaN, Infinity and lone surrogates
    parse. It counts the requests it read and answers each with *body* (default: a valid chat completion)."""

    def __init__(self, body: bytes | None = None) -> None:
        self.body = json.dumps(_completion()).encode() if body is None else body
        self.parsed = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        if scope["method"] == "POST":
            json.loads(raw)
            self.parsed += 1
        await send_body(send, 200, self.body)


def _failures(redis_url: str, rollout_id: str) -> list[str]:
    return [failure.reason for failure in manifest(redis_url, rollout_id).failures]


# --- fail-closed: a body the proxy cannot parse is refused, never forwarded ------------------------------------


LENIENT_BODIES: dict[str, dict[str, Any]] = {
    "nan-extra-field": {"temperature_jitter": float("nan")},
    "infinity-extra-field": {"bias": float("-inf")},
    "lone-surrogate": {"messages": [SYSTEM, {"role": "user", "content": "go \ud800"}]},
}


@pytest.mark.parametrize("case", sorted(LENIENT_BODIES))
def test_fail_closed_refuses_a_body_only_the_engine_can_parse(redis_url: str, case: str) -> None:
    """Python's ``json.dumps`` writes these bodies (NaN, -Infinity, a lone surrogate escape); the openai client
    refuses to, so they are sent as bytes."""
    fields = {"model": "simulated", "messages": MESSAGES, "max_tokens": 4, **LENIENT_BODIES[case]}
    content = json.dumps(fields).encode()
    upstream = LenientUpstream()
    with running_server(upstream) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, fail_closed=True))
        with running_server(proxy) as url:
            answer = httpx.post(
                f"{url}/r/lenient-1/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json"},
                timeout=20,
            )
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "InvalidRequest", answer.text
    assert upstream.parsed == 0  # never forwarded
    assert proxy.metrics.counts["capture_failed"] == 1


# --- fail-closed: every spelling of a captured route is captured or refused -------------------------------------

SPELLINGS = [
    "/r/{id}/v1/./chat/completions",
    "/r/{id}/v1/../v1/chat/completions",
    "/r/{id}//v1/chat/completions",
    "/r/{id}/v1//chat/completions",
    "/r/{id}/./v1/chat/completions",
    "/r/{id}/v1/chat/completions/",
    "/r/{id}/v1/%63hat/completions",
    "/r/{id}/v1/chat%2Fcompletions",
    "/r/{id}/v1/%2E/chat/completions",
    "/r/{id}/v1/%252E/chat/completions",
    "/r/{id}/v1/chat/completions/.",
    "//v1/chat/completions",
    "/v1/./chat/completions",
]


def _raw_post(base: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST *path* byte for byte (no client-side normalization, unlike httpx and the openai client)."""
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=20)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json", **headers})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        decoded = json.loads(data)
    except ValueError:
        decoded = {}
    return response.status, decoded if isinstance(decoded, dict) else {}


@pytest.mark.parametrize("fail_closed", [True, False], ids=["fail-closed", "fail-open"])
def test_every_spelling_of_a_captured_route_is_captured_or_refused(redis_url: str, fail_closed: bool) -> None:
    body = {"model": "simulated", "messages": MESSAGES, "max_tokens": 4, "min_tokens": 2}
    served: dict[str, int] = {}
    with running_server(EngineApp(EngineOptions(seed=3))) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, fail_closed=fail_closed))
        with running_server(proxy) as url:
            for index, spelling in enumerate(SPELLINGS):
                rollout_id = f"spell-{int(fail_closed)}-{index}"
                headers = {} if "{id}" in spelling else {"X-Staging-Rollout-Id": rollout_id}
                status, answer = _raw_post(url, spelling.format(id=rollout_id), body, headers)
                served[spelling] = status
                if status != 200:
                    continue
                records: list[CallRecord] = manifest(redis_url, rollout_id).records
                assert [r.response_id for r in records] == [answer["id"]], f"{spelling}: served 200, not captured"
                assert unset(answer, "prompt_token_ids") and unset(answer["choices"][0], "token_ids"), spelling
            # A literal percent sign on a route that is not captured is not an ambiguous spelling: it passes
            # (fail-open), or is refused as any rollout POST to an uncaptured route is (fail-closed).
            status, answer = _raw_post(url, "/r/spell-x/v1/files/a%25b", body, {})
            expected = (503, "UncapturedRoute") if fail_closed else (404, "NotFoundError")
            assert (status, answer["error"]["type"]) == expected, answer
    assert served["/r/{id}/v1/./chat/completions"] == 200  # normalized, then captured
    assert served["/r/{id}/v1/%63hat/completions"] == 200


# --- fail-open: an engine body the proxy cannot parse never reaches the agent with its token fields -------------

_VALID = json.dumps(_completion())
UNPARSEABLE = {
    "nan-logprob": _VALID.replace('"logprob": -0.5', '"logprob": NaN', 1),
    "infinite-logprob": _VALID.replace('"logprob": -0.5', '"logprob": -Infinity', 1),
    "out-of-range-logprob": _VALID.replace('"logprob": -0.5', '"logprob": -1e400', 1),
    "truncated": _VALID[: len(_VALID) - 20],
}


@pytest.mark.parametrize("case", sorted(UNPARSEABLE))
def test_fail_open_never_serves_token_ids_of_an_unparseable_engine_body(
    redis_url: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = LenientUpstream(UNPARSEABLE[case].encode())
    with running_server(upstream) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine))
        with running_server(proxy) as url:
            answer = httpx.post(
                f"{url}/r/unparsed-1/v1/chat/completions",
                json={"model": "simulated", "messages": MESSAGES, "max_tokens": 4},
                timeout=20,
            )
    assert upstream.parsed == 1
    assert "token_ids" not in answer.text and "token_id:" not in answer.text, answer.text
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "UpstreamUnparseable"
    assert _failures(redis_url, "unparsed-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert "not JSON" in caplog.text


# --- engine payloads that contradict themselves ---------------------------------------------------------------

CONTRADICTIONS = {
    "token-strings-disagree": _completion(token_strings=["token_id:5", "token_id:7"]),
    "no-ids-but-text": _completion(token_ids=[], token_strings=[]),
}


@pytest.mark.parametrize("case", sorted(CONTRADICTIONS))
def test_a_self_contradicting_engine_payload_fails_the_capture(
    redis_url: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = LenientUpstream(json.dumps(CONTRADICTIONS[case]).encode())
    with running_server(upstream) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine))
        with running_server(proxy) as url:
            completion = client_for(url, "contra-1").chat.completions.create(
                model="simulated", messages=MESSAGES, max_tokens=4
            )
    assert completion.choices[0].message.content == "fine"  # fail-open: served
    assert manifest(redis_url, "contra-1").records == []
    assert _failures(redis_url, "contra-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert proxy.metrics.counts["capture_failed"] == 1
    assert ("disagree" if case == "token-strings-disagree" else "no generated ids") in caplog.text


# --- a bug in the gate's commit reaches the per-request boundary -----------------------------------------------


class CommitBug(CaptureGate):
    """The proxy's own gate, with a bug in its commit (an exception the capture does not expect)."""

    def __init__(self, real: CaptureGate) -> None:
        self.real = real

    async def admit(self, rollout_id: str, request_items: Any, **options: Any) -> Any:
        return await self.real.admit(rollout_id, request_items, **options)

    async def abandon(self, admission: Any) -> None:
        await self.real.abandon(admission)

    async def commit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the gate's commit")

    def planned_commit(self, *args: Any, **kwargs: Any) -> Any:  # the row sent behind the stage
        raise RuntimeError("a bug in the gate's commit")


class CommitBugAfterTheStage(CommitBug):
    """No row behind the stage, so the bug is met after the stage, once the answer has been stripped."""

    def planned_commit(self, *args: Any, **kwargs: Any) -> Any:
        return None


@pytest.mark.parametrize("bug", [CommitBug, CommitBugAfterTheStage], ids=["in-the-stage", "after-the-stage"])
@pytest.mark.parametrize("fail_closed", [False, True], ids=["fail-open", "fail-closed"])
def test_a_bug_in_the_commit_reaches_the_boundary(
    redis_url: str, fail_closed: bool, bug: type[CommitBug], caplog: pytest.LogCaptureFixture
) -> None:
    """Fail-open still serves the answer stripped, wherever the bug is met (never the engine's unstripped bytes)."""
    with running_server(EngineApp(EngineOptions(seed=5))) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, fail_closed=fail_closed))
        with running_server(proxy) as url:
            assert proxy.middleware is not None
            proxy.middleware.gate = bug(proxy.middleware.gate)
            with caplog.at_level(logging.ERROR, logger="worker.proxy"):
                if fail_closed:
                    with pytest.raises(openai.InternalServerError) as raised:
                        client_for(url, "bug-1").chat.completions.create(
                            model="simulated", messages=MESSAGES, max_tokens=4
                        )
                    assert raised.value.status_code == 503
                else:
                    completion = client_for(url, "bug-1").chat.completions.create(
                        model="simulated", messages=MESSAGES, max_tokens=4
                    )
                    assert completion.choices[0].message.content is not None
                    assert unset(completion.model_extra, "prompt_token_ids")
                    assert completion.choices[0].logprobs is None
                    assert unset(completion.choices[0].model_extra, "token_ids")
    assert proxy.metrics.counts["capture_error"] == 1 and proxy.metrics.counts["capture_failed"] == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info is not None]
    assert errors and "a bug in the gate's commit" in caplog.text and "Traceback" in caplog.text
    assert _failures(redis_url, "bug-1") == [UNCOMMITTED_CALL_REASON]  # recorded failed: the rollout never trains


# --- groups through /r/{id}/finished ---------------------------------------------------------------------------


def test_finished_through_the_proxy_feeds_a_group_reader(redis_url: str) -> None:
    with running_server(EngineApp(EngineOptions(seed=9))) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine))
        with running_server(proxy) as url:
            for member, reward in (("grp-a", 1.0), ("grp-b", 0.0)):
                _, last_id = run_agent([url], member, turns=2)
                answer = httpx.post(
                    f"{url}/r/{member}/finished",
                    json={"reward": reward, "declared_response_id": last_id, "group_id": "prompt-7", "group_size": 2},
                )
                assert answer.status_code == 200, answer.text
            bad = httpx.post(f"{url}/r/grp-c/finished", json={"reward": 1.0, "group_id": "prompt-7"})
            assert bad.status_code == 422 and "group" in bad.text

    async def pull() -> list[RolloutGroup]:
        async with running_assembler(redis_url, block_ms=50), RolloutReader.from_url(redis_url) as reader:
            groups = GroupReader(reader)
            with anyio.fail_after(20):
                while not (delivered := await groups.pull_groups(2, block_ms=50)):
                    pass
            await groups.ack_groups(delivered)
            return delivered

    [group] = anyio.run(pull)
    assert group.group_id == "prompt-7" and group.complete and group.group_size == 2
    assert sorted(group.rollout_ids) == ["grp-a", "grp-b"] and group.reward_mean == 0.5
