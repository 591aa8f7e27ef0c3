"""The forwarder relays each request on its own: a cookie the upstream sets is never sent with a later request (of
another agent), and the upstream is reached directly even when the environment names an HTTP proxy (the upstream
is the engine the proxy fronts). Real uvicorn servers on both sides, the bare forwarding app between them. The
upstream target is the one an httpx client with the same ``base_url`` builds, for any path and query (the proxy
routes the path canonically, :func:`worker.proxy.routes.canonical_path`, and the engine must see that path).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.processes import free_port
from worker.asgi import Receive, Scope, Send, read_body, send_body
from worker.proxy.forward import ForwardingApp
from worker.proxy.serve import running_server


class CookieSettingUpstream:
    """Answers every request 200 with ``Set-Cookie``, recording the ``cookie`` header each request arrived with."""

    def __init__(self) -> None:
        self.cookies: list[bytes | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        self.cookies.append(dict(scope["headers"]).get(b"cookie"))
        await send_body(send, 200, b'{"ok":true}', headers=[(b"set-cookie", b"session=agent-one; Path=/")])


def test_a_cookie_the_upstream_sets_never_reaches_another_request() -> None:
    upstream = CookieSettingUpstream()
    with running_server(upstream) as upstream_url, running_server(ForwardingApp(upstream_url)) as url:
        for agent in ("one", "two"):  # two agents, each with its own client and no cookie of its own
            answer = httpx.post(f"{url}/v1/chat/completions", content=b"{}", headers={"x-agent": agent})
            assert answer.status_code == 200
            assert answer.headers["set-cookie"] == "session=agent-one; Path=/"  # relayed to the agent that got it
    assert upstream.cookies == [None, None]


def test_the_upstream_is_reached_directly_when_the_environment_names_an_http_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a request through it would fail
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, unreachable)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    upstream = CookieSettingUpstream()
    client = httpx.Client(trust_env=False)  # the test's own client goes straight to the forwarder
    with client, running_server(upstream) as upstream_url, running_server(ForwardingApp(upstream_url)) as url:
        answer = client.post(f"{url}/v1/chat/completions", content=b"{}")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"ok": True}
    assert len(upstream.cookies) == 1


_SEGMENTS = st.sampled_from(["", ".", "..", "v1", "chat", "completions", "a b", "é", "%2e", "x?y", "#f", ";p", "%"])
_PATHS = st.lists(_SEGMENTS, max_size=6).map(lambda parts: "/" + "/".join(parts))
_QUERIES = st.text(st.sampled_from("ak=&%20+?/#é"), max_size=8).map(lambda text: text.encode())
_BASES = ["http://127.0.0.1:8000", "http://engine:8000/prefix/", "https://[::1]:9/p", "http://host"]


@pytest.fixture(scope="module")
def reference_clients() -> Iterator[dict[str, httpx.Client]]:
    """Per upstream URL, an httpx client with it as ``base_url``: the reference that builds requests (never sends)."""
    with ExitStack() as stack:
        yield {base: stack.enter_context(httpx.Client(base_url=base.rstrip("/"), trust_env=False)) for base in _BASES}


@given(base=st.sampled_from(_BASES), path=_PATHS, query=_QUERIES, method=st.sampled_from(["POST", "GET", "DELETE"]), body=st.binary(max_size=3))
@settings(max_examples=300, deadline=None)
def test_the_upstream_target_is_the_one_an_httpx_client_builds(
    reference_clients: dict[str, httpx.Client], base: str, path: str, query: bytes, method: str, body: bytes
) -> None:
    """The engine sees the path an httpx client with the same ``base_url`` sends (percent-encoded, dot segments
    removed: what the proxy routed, ``worker.proxy.routes.canonical_path``), with its ``host`` and ``content-length``."""
    forwarder = ForwardingApp(base)
    headers = [(b"user-agent", b"agent")]
    try:
        reference = reference_clients[base].build_request(
            method, path, params=query.decode("latin-1") or None, headers=headers, content=body
        )
    except httpx.InvalidURL:
        with pytest.raises(httpx.InvalidURL):
            forwarder.upstream_request({"path": path, "query_string": query, "headers": headers, "method": method}, body)
        return
    request = forwarder.upstream_request({"path": path, "query_string": query, "headers": headers, "method": method}, body)
    expected = {name.lower(): value for name, value in reference.headers.raw}
    sent = dict(request.headers)
    assert (request.url.scheme, request.url.host, request.url.port) == (
        reference.url.raw_scheme,
        reference.url.raw_host,
        reference.url.port,
    )
    assert request.url.target == reference.url.raw_path
    assert sent[b"host"] == expected[b"host"]
    assert sent.get(b"content-length") == expected.get(b"content-length")
    assert sent[b"user-agent"] == b"agent" and sent[b"accept-encoding"] == b"identity"
