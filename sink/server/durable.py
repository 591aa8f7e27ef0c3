"""The durable server process: :class:`DurableServer` (a context manager) and :func:`serve_forever`.

A :class:`DurableServer` runs ``valkey-server`` or ``redis-server`` (found by :mod:`sink.server.binary`) as a
child process bound to loopback on a free port, with the durable configuration of contract §11.2:
``appendonly yes``, ``appendfsync always``, ``no-appendfsync-on-rewrite no`` and ``maxmemory-policy
noeviction``. Only options that Redis 6.2, Redis 7 and Valkey 8 all know are written.

No server outlives its owner: the context managers stop it on exit (SIGKILL if a clean stop fails), and
:mod:`sink.server.children` kills whatever is left at exit and gives the child a parent-death signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis

from sink.errors import ServerProcessError
from sink.server.binary import find_server_binary, server_version
from sink.server.children import (
    forget_process,
    forget_temp_dir,
    parent_death_hook,
    register_process,
    register_temp_dir,
)
from sink.server.loopback import LOOPBACK_HOST, free_port, server_client

__all__ = ("AppendFsync", "DurableServer", "serve_forever")

AppendFsync = Literal["always", "everysec", "no"]

_PORT_ATTEMPTS = 8
_POLL_INTERVAL_S = 0.02


def _quote(value: str | Path) -> str:
    text = os.fspath(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


class DurableServer:
    """One private server process with the durable configuration, restartable on the same directory and port.

    ``data_dir=None`` makes a temporary directory that :meth:`close` removes; a given directory is kept.
    ``port=None`` picks a free port (retrying if another process takes it first). Use it as a context
    manager, or call :meth:`start` and :meth:`close`.
    """

    host = LOOPBACK_HOST

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        appendfsync: AppendFsync = "always",
        maxmemory_bytes: int | None = None,
        replica_of: tuple[str, int] | None = None,
        cluster_enabled: bool = False,
        extra_config: Mapping[str, str] | None = None,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 20.0,
    ) -> None:
        self.binary = find_server_binary(binary)
        self.version = server_version(self.binary)
        self._owns_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="staging-sink-server-")) if data_dir is None else Path(data_dir)
        if self._owns_dir:
            register_temp_dir(self.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._auto_port = port is None
        self._port = port
        self._settings: dict[str, str] = {
            "appendonly": "yes",
            "appendfsync": appendfsync,
            "no-appendfsync-on-rewrite": "no",
            "maxmemory-policy": "noeviction",
            "save": '""',
        }
        if maxmemory_bytes is not None:
            self._settings["maxmemory"] = str(maxmemory_bytes)
        if replica_of is not None:
            self._settings["replicaof"] = f"{replica_of[0]} {replica_of[1]}"
        if cluster_enabled:
            self._settings |= {
                "cluster-enabled": "yes",
                "cluster-config-file": "nodes.conf",
                "cluster-node-timeout": "2000",
            }
        self._settings |= dict(extra_config or {})
        self._cluster_enabled = cluster_enabled
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The TCP port (fixed once the server first started)."""
        if self._port is None:
            raise ServerProcessError("the server has not been started yet, so it has no port")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The pid of the current (or last) server process."""
        if self._process is None:
            raise ServerProcessError("the server has not been started yet, so it has no pid")
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive (it may be paused)."""
        return self._process is not None and self._process.poll() is None

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` froze the process (until :meth:`resume`)."""
        return self._paused and self.running

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.data_dir / "server.log"

    def client(self, *, timeout_s: float = 5.0) -> redis.Redis:
        """A synchronous client of this server (close it, or use ``with``)."""
        return server_client(self.port, timeout_s=timeout_s)

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the server log and of its stderr."""
        chunks = []
        for path in (self.log_path, self.data_dir / "server.stderr"):
            if path.exists():
                chunks.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(chunks)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> Self:
        """Start the server and wait until it answers PING with its data loaded.

        :raises ServerProcessError: if it dies at startup or is not ready within ``startup_timeout_s``.
        """
        if self.running:
            raise ServerProcessError(f"server on port {self.port} is already running")
        for attempt in range(_PORT_ATTEMPTS if self._auto_port else 1):
            if self._auto_port and (self._port is None or attempt > 0):
                self._port = free_port(with_cluster_bus=self._cluster_enabled)
            if self._launch_and_wait():
                return self
        raise ServerProcessError(f"no free port after {_PORT_ATTEMPTS} attempts:\n{self.log_tail()}")

    def _write_config(self) -> Path:
        settings = {
            "bind": LOOPBACK_HOST,
            "protected-mode": "yes",
            "port": str(self.port),
            "daemonize": "no",
            "dir": _quote(self.data_dir),
            "logfile": _quote(self.log_path),
        } | self._settings
        config_path = self.data_dir / "server.conf"
        config_path.write_text("".join(f"{name} {value}\n" for name, value in settings.items()))
        return config_path

    def _launch_and_wait(self) -> bool:
        """Launch once; ``False`` when the port was taken (caller retries), ``True`` when ready."""
        config_path = self._write_config()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with (self.data_dir / "server.stderr").open("ab") as stderr:
            process = subprocess.Popen(
                [os.fspath(self.binary), os.fspath(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                cwd=self.data_dir,
                start_new_session=True,
                preexec_fn=parent_death_hook(),  # noqa: PLW1509 - deliberate, see the module docstring
            )
        self._process, self._paused = process, False
        register_process(process)
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if process.poll() is not None:
                forget_process(process)
                fresh_log = self.log_path.read_bytes()[log_start:] if self.log_path.exists() else b""
                if self._auto_port and b"already in use" in fresh_log:
                    return False
                raise ServerProcessError(
                    f"{self.binary} exited with {process.returncode} at startup:\n{self.log_tail()}"
                )
            if self._is_ready(process.pid):
                return True
            if time.monotonic() > deadline:
                self.kill()
                raise ServerProcessError(
                    f"{self.binary} not ready within {self._startup_timeout_s}s on port {self.port}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _is_ready(self, pid: int) -> bool:
        try:
            with self.client(timeout_s=2.0) as probe:
                probe.ping()
                info = probe.info()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False
        # Another process answering on our port is not our server.
        return int(info.get("process_id", -1)) == pid and int(info.get("loading", 1)) == 0

    def stop(self) -> None:
        """Shut the server down cleanly (``SHUTDOWN``, SIGTERM as fallback) and wait for it to exit.

        :raises ServerProcessError: if it does not exit within ``stop_timeout_s`` (it is then killed).
        """
        process = self._process
        if process is None or process.poll() is not None:
            return
        self.resume()
        try:
            with self.client(timeout_s=self._stop_timeout_s) as connection:
                connection.shutdown()
        except redis.RedisError:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=self._stop_timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            raise ServerProcessError(
                f"server on port {self.port} did not stop within {self._stop_timeout_s}s; killed it:\n{self.log_tail()}"
            ) from exc
        finally:
            forget_process(process)

    def kill(self) -> None:
        """SIGKILL the server (a crash: whatever was not fsynced is lost) and reap it."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._paused = False
        forget_process(process)

    def restart(self) -> Self:
        """Stop the server if it runs, then start it again on the same directory, port and configuration.

        :raises ServerProcessError: as :meth:`start` and :meth:`stop`.
        """
        self.stop()
        self._process = None
        if not self._launch_and_wait():
            raise ServerProcessError(f"port {self.port} was taken while the server was down:\n{self.log_tail()}")
        return self

    def pause(self) -> None:
        """Freeze the process with SIGSTOP (it stops answering; connections stay open)."""
        if self.running and self._process is not None:
            self._process.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Thaw a paused process with SIGCONT."""
        if self._paused and self.running and self._process is not None:
            self._process.send_signal(signal.SIGCONT)
        self._paused = False

    def close(self) -> None:
        """Stop the server (killing it if a clean stop fails) and remove the data directory if this owns it.

        :raises ServerProcessError: if the clean stop failed (the process is gone all the same).
        """
        try:
            self.stop()
        finally:
            self.kill()
            if self._owns_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)
                forget_temp_dir(self.data_dir)

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def serve_forever(
    *,
    binary: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    port: int | None = None,
    appendfsync: AppendFsync = "always",
) -> int:
    """Run a durable server in the foreground for ``staging-sink server``: print its URL, block until
    SIGINT/SIGTERM, stop cleanly. Returns the process exit code (1 if the server died on its own).
    Call it from the main thread.

    :raises ServerNotFoundError: when no server binary is installed.
    :raises ServerProcessError: when the server does not come up or does not stop.
    """
    stop_requested = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop_requested.set()

    previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with DurableServer(binary=binary, data_dir=data_dir, port=port, appendfsync=appendfsync) as server:
            sys.stdout.write(f"{server.url}\n")
            sys.stdout.write(f"# {server.binary} {server.version}, data in {server.data_dir}; Ctrl-C stops it\n")
            sys.stdout.flush()
            while not stop_requested.wait(0.5):
                if not server.running:
                    sys.stderr.write(f"server exited unexpectedly:\n{server.log_tail()}\n")
                    return 1
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
