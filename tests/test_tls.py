"""TLS between the staging components and the server: ``rediss://`` URLs with ``?ssl_ca_certs=<path>``.

A throwaway CA and server certificate are made with trustme; the server listens on TLS only (``port 0``).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.asyncio as aioredis
import trustme
from redis.backoff import NoBackoff
from redis.retry import Retry

from sink.server import DurableServer
from tests.helpers.processes import free_port
from tests.helpers.servers import import_or_skip, skip_or_fail

TLS_FAILURE = r"(?i)certificate|ssl|tls"


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    foreign_ca: Path


class TlsServer(DurableServer):
    """A durable server on a TLS port only; its own client (readiness, SHUTDOWN) speaks TLS."""

    def __init__(self, *, ca_path: Path, **kwargs: Any) -> None:
        self.ca_path = ca_path
        super().__init__(**kwargs)

    def client(self, *, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis(
            host=self.host,
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.ca_path),
            socket_timeout=timeout_s,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )

    def tls_url(self, ca_path: Path | None = None) -> str:
        return f"rediss://{self.host}:{self.port}?ssl_ca_certs={quote(str(ca_path or self.ca_path))}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1", "localhost")
    pki = Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key", directory / "other-ca.pem")
    authority.cert_pem.write_to_path(str(pki.ca))
    issued.cert_chain_pems[0].write_to_path(str(pki.cert))
    issued.private_key_pem.write_to_path(str(pki.key))
    trustme.CA().cert_pem.write_to_path(str(pki.foreign_ca))
    return pki


@pytest.fixture(scope="module")
def tls_server(
    durable_server: DurableServer, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsServer]:
    with durable_server.client() as probe:
        if not probe.config_get("tls-port"):
            skip_or_fail(f"{durable_server.binary} {durable_server.version} is built without TLS (no tls-port)")
    port = free_port()
    server = TlsServer(
        ca_path=pki.ca,
        binary=durable_server.binary,
        data_dir=tmp_path_factory.mktemp("tls-server"),
        port=port,
        extra_config={
            "port": "0",
            "tls-port": str(port),
            "tls-cert-file": str(pki.cert),
            "tls-key-file": str(pki.key),
            "tls-ca-cert-file": str(pki.ca),
            "tls-auth-clients": "no",
        },
    )
    with server:
        yield server


def test_the_server_speaks_tls_only(tls_server: TlsServer) -> None:
    with tls_server.client() as client:
        assert client.ping() is True
        assert client.config_get("port") == {"port": "0"}
    no_retry = Retry(NoBackoff(), 0)
    with (
        redis.Redis(host=tls_server.host, port=tls_server.port, socket_timeout=1, retry=no_retry) as plain,
        pytest.raises(redis.ConnectionError),
    ):
        plain.ping()


@pytest.mark.anyio
async def test_a_raw_async_client_verifies_the_server_against_the_ca(tls_server: TlsServer, pki: Pki) -> None:
    async with aioredis.Redis.from_url(tls_server.tls_url()) as client:
        assert await client.set("stg:{t0}:rec:c1", b"x") is True
    async with aioredis.Redis.from_url(tls_server.tls_url(pki.foreign_ca)) as stranger:
        with pytest.raises(redis.ConnectionError, match=TLS_FAILURE) as refused:
            await stranger.ping()
    assert isinstance(refused.value.__context__ or refused.value, ssl.SSLError | redis.ConnectionError)


@pytest.mark.anyio
async def test_sink_and_source_work_over_tls(tls_server: TlsServer) -> None:
    redis_sink = import_or_skip("sink.store.sink")
    source_module = import_or_skip("sink.store.source")
    from tests.helpers.staging import make_chain

    root, child = make_chain("t1", 2)
    async with redis_sink.AsyncRedisStagingSink.from_url(tls_server.tls_url()) as sink:
        results = [await sink.stage(root), await sink.stage(child)]
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    async with source_module.AsyncRedisStagingSource.from_url(tls_server.tls_url()) as source:
        fetched = await source.fetch([child.staging_key, root.staging_key])
    assert [s.digest for s in fetched] == [child.digest, root.digest]


@pytest.mark.anyio
async def test_a_wrong_ca_fails_cleanly(tls_server: TlsServer, pki: Pki) -> None:
    redis_sink = import_or_skip("sink.store.sink")
    source_module = import_or_skip("sink.store.source")
    from sink.errors import StagingConnectionError
    from tests.helpers.staging import make_record

    url = tls_server.tls_url(pki.foreign_ca)
    async with redis_sink.AsyncRedisStagingSink.from_url(url, connect_timeout_s=2.0) as sink:
        result = await sink.stage(make_record("t2", "c1"))
    assert result.ok is False
    assert result.error is not None and re.search(TLS_FAILURE, result.error), result.error
    async with source_module.AsyncRedisStagingSource.from_url(url, connect_timeout_s=2.0) as source:
        with pytest.raises(StagingConnectionError, match=TLS_FAILURE):
            await source.fetch(["t1/c0"])


@pytest.mark.anyio
async def test_a_plain_url_against_the_tls_port_fails_cleanly(tls_server: TlsServer) -> None:
    redis_sink = import_or_skip("sink.store.sink")
    from tests.helpers.staging import make_record

    plain = f"redis://{tls_server.host}:{tls_server.port}"
    async with redis_sink.AsyncRedisStagingSink.from_url(plain, connect_timeout_s=2.0, command_timeout_s=2.0) as sink:
        result = await sink.stage(make_record("t3", "c1"))
    assert result.ok is False and result.error
