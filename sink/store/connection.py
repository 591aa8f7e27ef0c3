"""The Redis router and error boundary: clients, cluster routing, and the one place redis-py errors are translated.

Lua scripts are loaded and run by :mod:`sink.store.scripts`, not here.

A :class:`Topology` hides the difference between one server and a cluster:
it maps keys to the primary that owns their slot and hands out a plain
``redis.asyncio.Redis`` client per primary, so a caller can pipeline a write
and its ``WAIT`` on one connection of that node.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection

from sink.errors import (
    ClusterModeMismatchError,
    CodecError,
    StagingConnectionError,
    StagingRefusedError,
    StagingUnavailableError,
)
from sink.settings import ConnectionSettings

__all__ = (
    "TOPOLOGY_REPLIES",
    "Topology",
    "connect",
    "describe_redis_error",
    "is_topology_reply",
    "map_redis_errors",
    "reply_text",
    "translate_redis_error",
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def reply_text(value: object, what: str = "reply", *, lenient: bool = False) -> str:
    """A server reply element as text (clients run with ``decode_responses`` off): the package's one decoder.

    *lenient* (for display: the command line) replaces invalid UTF-8 and turns any other value into ``str()``.

    :raises CodecError: (not *lenient*) the element is not UTF-8 text; *what* names the reply in the message.
    """
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8", errors="replace" if lenient else "strict")
        except UnicodeDecodeError as exc:
            raise CodecError(f"{what} is not UTF-8: {exc}") from exc
    if isinstance(value, str):
        return value
    if lenient:
        return str(value)
    raise CodecError(f"unexpected {what} element {type(value).__name__}")


def describe_redis_error(exc: BaseException) -> str:
    """A one-line description of a redis-py error that names its kind."""
    kind = type(exc).__name__
    text = str(exc).strip() or repr(exc)
    return f"{kind}: {text}"


# Error replies of a cluster whose slot map changed under the client (a failover, a slot migration, a node that
# stepped down): the command did not run where it was sent. Reloading the slot map and sending it again fixes them.
TOPOLOGY_REPLIES: tuple[type[redis_errors.RedisError], ...] = (
    redis_errors.AskError,  # ASK, and MOVED (MovedError is an AskError)
    redis_errors.ReadOnlyError,  # READONLY: a replica now (a script without keys, a command queued over the switch)
    redis_errors.TryAgainError,  # TRYAGAIN: a multi-key command over a slot half migrated
    redis_errors.ClusterDownError,  # CLUSTERDOWN, MASTERDOWN
    redis_errors.ClusterError,  # the cluster client's "TTL exhausted": every attempt of it was redirected
)
# The code redis-py's own errors of these kinds carry when no reply named one (most specific class first).
_TOPOLOGY_CODES = {
    redis_errors.MovedError: "MOVED",
    redis_errors.AskError: "ASK",
    redis_errors.ReadOnlyError: "READONLY",
    redis_errors.TryAgainError: "TRYAGAIN",
    redis_errors.MasterDownError: "MASTERDOWN",
    redis_errors.ClusterDownError: "CLUSTERDOWN",
}
# A blocked read on a node that stepped down to a replica is ended with this (the stream and its group are intact).
_STEPPED_DOWN = "instance state changed"
_REDIRECT_PAUSE_S, _REDIRECT_PAUSE_MAX_S = 0.05, 1.0


def is_topology_reply(exc: BaseException) -> bool:
    """Whether *exc* (a redis-py error) is a cluster's answer that its topology changed (see
    :data:`TOPOLOGY_REPLIES`; also ``UNBLOCKED`` of a read blocked on a node that stepped down)."""
    if isinstance(exc, TOPOLOGY_REPLIES):
        return True
    return isinstance(exc, redis_errors.ResponseError) and _reply_code(exc) == "UNBLOCKED" and _STEPPED_DOWN in str(exc)


def _reply_code(exc: redis_errors.RedisError) -> str:
    """The code of an error reply: redis-py keeps it in ``status_code`` when it knows the prefix and strips it
    from the message; otherwise the message still starts with it (``WRONGTYPE Operation against ...``)."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    for kind, topology_code in _TOPOLOGY_CODES.items():
        if isinstance(exc, kind):
            return topology_code  # raised by redis-py itself (a slot no node serves), not parsed from a reply
    first = str(exc).split(" ", 1)[0]
    return first if first.isupper() and first.isalpha() else "ERR"


def translate_redis_error(exc: redis_errors.RedisError | OSError, action: str) -> StagingConnectionError:
    """The package's error for a redis-py (or socket) error: unavailable, or refused with the reply's code.

    This is the one place that tells the two apart; everything above catches the types. A topology change
    (:func:`is_topology_reply`: ``MOVED``, ``ASK``, ``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN``) is unavailable
    with its reply's code, as is ``LOADING``; every other error reply is refused with its code.

    :param action: what was being done, for the message (``"fetch records"``).
    """
    message = f"could not {action}: {describe_redis_error(exc)}"
    if isinstance(exc, redis_errors.AuthenticationError | redis_errors.AuthorizationError):
        return StagingRefusedError(message, _reply_code(exc))  # WRONGPASS, NOAUTH, NOPERM (before any command)
    if is_topology_reply(exc):
        assert isinstance(exc, redis_errors.RedisError)
        code = _reply_code(exc) if isinstance(exc, redis_errors.ResponseError) else None  # none: TTL exhausted
        return StagingUnavailableError(message, code)
    if isinstance(exc, redis_errors.ResponseError):
        return StagingRefusedError(message, _reply_code(exc))
    if isinstance(exc, redis_errors.DataError):
        return StagingRefusedError(message, "DATAERROR")  # refused by the client before it was sent
    # ConnectionError (BusyLoadingError: LOADING), TimeoutError, OSError, a garbled reply.
    code = getattr(exc, "status_code", None)
    return StagingUnavailableError(message, code if isinstance(code, str) and code else None)


@contextlib.contextmanager
def map_redis_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors raised inside the block (:func:`translate_redis_error`).

    :param action: what was being done, for the message (``"fetch records"``).
    :raises StagingUnavailableError: the server could not be reached, or the cluster's topology changed.
    :raises StagingRefusedError: the server answered with an error.
    """
    try:
        yield
    except (redis_errors.RedisError, OSError) as exc:
        raise translate_redis_error(exc, action) from exc


def _has_outage(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_has_outage(inner) for inner in exc.exceptions)
    return isinstance(exc, StagingUnavailableError)


def _init_parameters(cls: type) -> frozenset[str]:
    """Keyword parameters accepted by ``cls.__init__`` along its MRO (they chain via ``**kwargs``)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters)
    return frozenset(names - {"self", "args", "kwargs"})


def _timeouts(settings: ConnectionSettings) -> dict[str, Any]:
    return {
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": settings.socket_timeout_s,
    }


def connect(url: str, settings: ConnectionSettings) -> aioredis.Redis | RedisCluster:
    """A new client for *url* with *settings*' pool size and timeouts (a cluster client when ``settings.cluster``)."""
    if settings.cluster:
        return RedisCluster.from_url(url, max_connections=settings.max_connections, **_timeouts(settings))
    # A blocking pool makes callers beyond max_connections wait instead of failing.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=settings.max_connections, timeout=settings.connect_timeout_s, **_timeouts(settings)
    )
    return aioredis.Redis.from_pool(pool)


class Topology:
    """Routes keys to per-primary clients, for one server or a cluster.

    Build with :meth:`from_url` (owns its clients) or :meth:`borrow`, and
    close with :meth:`aclose`; per-node clients it creates are always its own.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, settings: ConnectionSettings, *, owned: bool) -> None:
        """*owned*: :meth:`aclose` closes *client* (else it leaves it open for its owner).

        :raises TypeError: *client* is not a ``redis.asyncio`` client.
        """
        if not isinstance(client, aioredis.Redis | RedisCluster):
            raise TypeError(f"expected a redis.asyncio client, got {type(client).__name__}")
        self._settings = settings
        self._owned = owned
        self._cluster: RedisCluster | None = client if isinstance(client, RedisCluster) else None
        self._single: aioredis.Redis | None = client if isinstance(client, aioredis.Redis) else None
        self._node_clients: dict[tuple[str, int], aioredis.Redis] = {}
        self._client_kwargs: dict[str, Any] = _timeouts(settings)

    @classmethod
    def from_url(cls, url: str, settings: ConnectionSettings) -> Topology:
        """Create clients for *url* (:func:`connect`); :meth:`aclose` closes them."""
        return cls(connect(url, settings), settings, owned=True)

    @classmethod
    def borrow(cls, client: aioredis.Redis | RedisCluster, settings: ConnectionSettings) -> Topology:
        """Use a caller's client; :meth:`aclose` leaves it open."""
        return cls(client, settings, owned=False)

    @property
    def is_cluster(self) -> bool:
        return self._cluster is not None

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        """A client for keyed single-slot commands (the cluster client routes by key)."""
        client = self._cluster if self._cluster is not None else self._single
        assert client is not None
        return client

    async def initialize(self) -> None:
        """Load the cluster topology (no-op for a single server).

        :raises ClusterModeMismatchError: the topology is a cluster's but the server is standalone.
        """
        if self._cluster is not None:
            try:
                await self._cluster.initialize()
            except redis_errors.RedisClusterException as exc:  # one clear line, not a redis-py traceback
                if "not enabled" not in str(exc):
                    raise
                raise ClusterModeMismatchError(f"cluster=True (--cluster) but the server is standalone: {exc}") from exc

    async def refresh(self) -> None:
        """Reload the slot map after MOVED/failover errors (no-op for a single server)."""
        if self._cluster is not None:
            await self._cluster.nodes_manager.initialize()

    async def refresh_quietly(self) -> None:
        """:meth:`refresh`, a failure only logged: the next command reports the outage, translated, and is
        retried (a refresh reaches no node while the cluster is down)."""
        try:
            await self.refresh()
        except (redis_errors.RedisError, redis_errors.RedisClusterException, OSError) as exc:
            logger.warning("could not reload the cluster's slot map: %s", describe_redis_error(exc))

    @contextlib.asynccontextmanager
    async def translated(self, action: str) -> AsyncIterator[None]:
        """:func:`map_redis_errors` for commands sent through this topology's clients; in a cluster, an outage
        (a topology change, a node that cannot be reached) also reloads the slot map before it propagates, so
        the caller's next attempt goes to the slot's owner now (one a failover or a migration made)."""
        try:
            with map_redis_errors(action):
                yield
        except (StagingUnavailableError, BaseExceptionGroup) as exc:
            if self._cluster is not None and _has_outage(exc):
                await self.refresh_quietly()
            raise

    async def retry_redirected(self, attempt: Callable[[], Awaitable[T]], *, budget_s: float) -> T:
        """``await attempt()``, sent again while the cluster answers with a topology change
        (:func:`is_topology_reply`: the command did not run), each time after :meth:`wait_for_redirect`, for up to
        *budget_s*; then the last such error is raised (untranslated)."""
        deadline = anyio.current_time() + budget_s
        for tries in itertools.count():
            try:
                return await attempt()
            except redis_errors.RedisError as exc:
                if not is_topology_reply(exc) or not await self.wait_for_redirect(deadline, tries):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def wait_for_redirect(self, deadline: float, tries: int) -> bool:
        """Before sending again what the cluster redirected after *tries* earlier tries: ``False`` when the pause
        (doubling from 50 ms, at most 1 s) would end past *deadline* (``anyio.current_time()``), else pause,
        reload the slot map and return ``True``."""
        pause = min(_REDIRECT_PAUSE_S * 2**tries, _REDIRECT_PAUSE_MAX_S)
        if anyio.current_time() + pause > deadline:
            return False
        await anyio.sleep(pause)
        await self.refresh_quietly()
        return True

    def _node_client(self, host: str, port: int) -> aioredis.Redis:
        key = (host, port)
        client = self._node_clients.get(key)
        if client is None:
            # Same credentials/TLS/timeouts as the cluster (or single-server) client, for one node.
            connection_class: type[AbstractConnection]
            if self._cluster is not None:
                inherited = self._cluster.get_connection_kwargs()
                connection_class = inherited.get("connection_class") or aioredis.Connection
            else:
                assert self._single is not None
                inherited = dict(self._single.connection_pool.connection_kwargs)
                connection_class = self._single.connection_pool.connection_class
            accepted = _init_parameters(connection_class)
            kwargs: dict[str, Any] = {k: v for k, v in inherited.items() if k in accepted}
            kwargs.update(self._client_kwargs)
            kwargs.update(host=host, port=port)
            pool = aioredis.BlockingConnectionPool(
                connection_class=connection_class,
                max_connections=self._settings.max_connections,
                timeout=self._settings.connect_timeout_s,
                **kwargs,
            )
            client = aioredis.Redis.from_pool(pool)
            self._node_clients[key] = client
        return client

    async def standalone_replicas(self) -> list[aioredis.Redis]:
        """One client per replica a single server reports online (``INFO replication``); none in a cluster,
        whose replicas :meth:`all_nodes` already lists."""
        if self._single is None:
            return []
        info = await self._single.info("replication")
        replicas = []
        for name, value in sorted(info.items()):
            if str(name).startswith("slave") and isinstance(value, dict) and value.get("state") == "online":
                replicas.append(self._node_client(str(value["ip"]), int(value["port"])))
        return replicas

    def node_for_key(self, key: str) -> aioredis.Redis:
        """The client of the primary that owns *key*'s slot."""
        if self._single is not None:
            return self._single
        assert self._cluster is not None
        node = self._cluster.nodes_manager.get_node_from_slot(self._cluster.keyslot(key))
        return self._node_client(node.host, int(node.port))

    def slot_of(self, key: str) -> int:
        """The cluster slot of *key* (0 for a single server)."""
        if self._cluster is None:
            return 0
        return int(self._cluster.keyslot(key))

    def primaries(self) -> list[aioredis.Redis]:
        """One client per primary."""
        if self._single is not None:
            return [self._single]
        assert self._cluster is not None
        return [self._node_client(node.host, int(node.port)) for node in self._cluster.get_primaries()]

    async def all_nodes(self) -> list[aioredis.Redis]:
        """One client per node, primaries and replicas (from ``CLUSTER NODES``)."""
        if self._single is not None:
            return [self._single]
        assert self._cluster is not None
        nodes = await self._cluster.cluster_nodes()
        clients = []
        for address, info in sorted(nodes.items()):
            flags = str(info.get("flags", ""))
            if "fail" in flags or "noaddr" in flags or "handshake" in flags:
                continue
            host, _, port = address.rpartition(":")
            clients.append(self._node_client(host, int(port.split("@")[0])))
        return clients

    def group_by_slot(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Indices of *keys* grouped by cluster slot, in first-seen order."""
        groups: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            groups.setdefault(self.slot_of(key), []).append(index)
        return groups

    async def aclose(self) -> None:
        """Close every client this topology created."""
        clients: list[aioredis.Redis] = list(self._node_clients.values())
        self._node_clients.clear()
        for client in clients:
            await client.aclose()
        if not self._owned:
            return
        if self._single is not None:
            await self._single.aclose()
        if self._cluster is not None:
            await self._cluster.aclose()
