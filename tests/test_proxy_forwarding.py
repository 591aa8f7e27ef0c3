"""The forwarder relays each request on its own: a cookie the upstream sets is never sent with a later request (of
another agent), and the upstream is reached directly even when the environment names an HTTP proxy (the upstream
is the engine the proxy fronts). A pooled connection the upstream dropped is retried once on a new connection, and
an upstream that cannot be reached is answered 502. Real servers on both sides (uvicorn, or a raw HTTP/1.1 socket
server where the test needs a connection dropped), the bare forwarding app between them. The upstream target is
the one an httpx client with the same ``base_url`` builds, for any path and query (the proxy routes the path
canonically, :func:`worker.proxy.routes.canonical_path`, and the engine must see that path).
"""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.processes import free_port
from worker.asgi import Receive, Scope, Send, read_body, send_body
from worker.proxy.forward import UPSTREAM_TIMEOUT_HEADER, ForwardingApp
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



class FirstRequestOnlyUpstream(socketserver.ThreadingTCPServer):
    """A raw HTTP/1.1 upstream that answers the first request of each connection (keep-alive) and closes the
    connection without a word on the next one: what a pooled connection the server dropped looks like."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FirstRequestOnly)
        self.connections = 0
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FirstRequestOnly(socketserver.StreamRequestHandler):
    server: FirstRequestOnlyUpstream

    def handle(self) -> None:
        self.server.connections += 1
        for answered in (False, True):
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = self.rfile.readline()
                if not line:
                    return
                head += line
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
            length = int(fields.get(b"content-length", fields.get(b"Content-Length", b"0")))
            self.rfile.read(length)
            self.server.requests += 1
            if answered:
                return  # the second request on this connection: closed unanswered
            body = b'{"ok":true}'
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            self.wfile.write(head + body)
            self.wfile.flush()


def test_a_pooled_connection_the_upstream_dropped_is_retried_once_on_a_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker.proxy.forward")
    upstream = FirstRequestOnlyUpstream()
    served = threading.Thread(target=upstream.serve_forever, daemon=True)
    served.start()
    try:
        with running_server(ForwardingApp(upstream.url)) as url, httpx.Client(trust_env=False) as client:
            answers = [client.post(f"{url}/v1/chat/completions", content=b"{}") for _ in range(2)]
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert [answer.status_code for answer in answers] == [200, 200]
    assert [answer.json() for answer in answers] == [{"ok": True}, {"ok": True}]
    assert (upstream.connections, upstream.requests) == (2, 3)  # the second request went out twice, once per connection
    assert "dropped a pooled connection" in caplog.text


def test_an_unreachable_upstream_is_answered_502_by_the_forwarder(caplog: pytest.LogCaptureFixture) -> None:
    with running_server(ForwardingApp(f"http://127.0.0.1:{free_port()}")) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", content=b"{}")
    assert answer.status_code == 502
    assert answer.headers[UPSTREAM_TIMEOUT_HEADER.decode()] == "UpstreamUnreachable"
    assert answer.json()["error"]["type"] == "UpstreamUnreachable"
    assert "unreachable" in caplog.text


_SEGMENTS = st.sampled_from(["", ".", "..", "v1", "chat", "completions", "a b", "é", "%2e", "x?y", "#f", ";p", "%"])
_PATHS = st.lists(_SEGMENTS, max_size=6).map(lambda parts: "/" + "/".join(parts))
_QUERIES = st.text(st.sampled_from("ak=&%20+?/#é"), max_size=8).map(lambda text: text.encode())
_BASES = ["http://127.0.0.1:8000", "http://engine:8000/prefix/", "https://[::1]:9/p", "http://host"]


@pytest.fixture(scope="module")
def reference_clients() -> Iterator[dict[str, httpx.Client]]:
    """Per upstream URL, an httpx client with it as ``base_url``: the reference that builds requests (never sends)."""
    with ExitStack() as stack:
        yield {base: stack.enter_context(httpx.Client(base_url=base.rstrip("/"), trust_env=False)) for base in _BASES}


_METHODS = st.sampled_from(["POST", "GET", "DELETE"])


@given(base=st.sampled_from(_BASES), path=_PATHS, query=_QUERIES, method=_METHODS, body=st.binary(max_size=3))
@settings(max_examples=300, deadline=None)
def test_the_upstream_target_is_the_one_an_httpx_client_builds(
    reference_clients: dict[str, httpx.Client], base: str, path: str, query: bytes, method: str, body: bytes
) -> None:
    """The engine sees the path an httpx client with the same ``base_url`` sends (percent-encoded, dot segments
    removed: what the proxy routed, ``worker.proxy.routes.canonical_path``), with its ``host`` and
    ``content-length``."""
    forwarder = ForwardingApp(base)
    headers = [(b"user-agent", b"agent")]
    scope = {"path": path, "query_string": query, "headers": headers, "method": method}
    try:
        reference = reference_clients[base].build_request(
            method, path, params=query.decode("latin-1") or None, headers=headers, content=body
        )
    except httpx.InvalidURL:
        with pytest.raises(httpx.InvalidURL):
            forwarder.upstream_request(scope, body)
        return
    request = forwarder.upstream_request(scope, body)
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
