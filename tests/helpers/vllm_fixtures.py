"""Fixtures of the real-vLLM tier (a pytest plugin loaded by ``tests/conftest.py``).

``vllm_fleet`` (session): on first use it builds the three tiny models and starts one vLLM server per variant, all
at once (their start-ups overlap); ``vllm_chatml``, ``vllm_reasoning``, ``vllm_tools`` wait for their own server.
Every server is stopped by PID at the session's end. Tests using them get the ``vllm`` marker automatically;
without ``STAGING_SINK_VLLM_ENV`` they are deselected locally, and fail in CI.

For a developer's edit-run loop, ``STAGING_SINK_VLLM_REUSE=DIR`` (never set by ``scripts/test``) reuses servers
already running: ``DIR/<variant>.url`` holds a base URL and ``DIR/<variant>/`` the model folder
(:func:`tests.helpers.vllm_server.build_model`'s output); they are left running.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sink import server as sink_server
from tests.helpers.servers import require_binary
from tests.helpers.vllm_server import (
    VllmServer,
    build_model,
    ipc_dir_of,
    require_vllm,
    start_vllm,
    stop_vllm,
    wait_ready,
)

__all__ = ("VllmFleet",)

VARIANTS = ("chatml", "reasoning", "tools")


class VllmFleet:
    """One vLLM server per model variant, started together, each awaited on first use."""

    def __init__(self, python: Path, work_dir: Path) -> None:
        self.python = python
        self.work_dir = work_dir
        self._processes: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self._vocab: dict[str, dict[str, int]] = {}
        self._ready: dict[str, VllmServer] = {}
        self._models = work_dir

    def start(self) -> None:
        """Build every model (in parallel) and start every server (without waiting)."""
        with ThreadPoolExecutor(len(VARIANTS)) as pool:
            vocabs = pool.map(lambda v: build_model(self.python, self.work_dir / v, v), VARIANTS)
            for variant, vocab in zip(VARIANTS, vocabs, strict=True):
                self._vocab[variant] = vocab
        for variant in VARIANTS:
            log = self.work_dir / f"{variant}.log"
            self._processes[variant] = start_vllm(self.python, self.work_dir / variant, variant, log)

    def reuse(self, folder: Path) -> None:
        """Use the servers described in *folder* (see the module docstring) instead of starting any."""
        self._models = folder
        for variant in VARIANTS:
            url = (folder / f"{variant}.url").read_text().strip()
            vocab = json.loads((folder / variant / "staging_sink_variant.json").read_text())["vocab"]
            self._ready[variant] = VllmServer(variant, url, variant, vocab, pid=0)

    def server(self, variant: str) -> VllmServer:
        """The ready server of *variant* (waits for it the first time)."""
        if variant not in self._ready:
            process, url = self._processes[variant]
            log = self.work_dir / f"{variant}.log"
            wait_ready(process, url, log)
            self._ready[variant] = VllmServer(variant, url, variant, self._vocab[variant], process.pid, ipc_dir_of(log))
        return self._ready[variant]

    def model_dir(self, variant: str) -> Path:
        """The folder of *variant*'s model (:func:`tests.helpers.vllm_server.build_model`'s output)."""
        return self._models / variant

    def stop(self) -> None:
        """Stop every server by its PID."""
        for process, _ in self._processes.values():
            stop_vllm(process)


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    python = require_vllm()
    if python is None:  # deselected before this point; reached only when a test is selected by hand
        pytest.skip("STAGING_SINK_VLLM_ENV is not set")
    fleet = VllmFleet(python, tmp_path_factory.mktemp("vllm"))
    reuse = os.environ.get("STAGING_SINK_VLLM_REUSE", "").strip()
    if reuse:
        fleet.reuse(Path(reuse))
        yield fleet
        return
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def vllm_chatml(vllm_fleet: VllmFleet) -> VllmServer:
    return vllm_fleet.server("chatml")


@pytest.fixture(scope="session")
def vllm_reasoning(vllm_fleet: VllmFleet) -> VllmServer:
    return vllm_fleet.server("reasoning")


@pytest.fixture(scope="session")
def vllm_tools(vllm_fleet: VllmFleet) -> VllmServer:
    return vllm_fleet.server("tools")


@pytest.fixture(scope="session")
def _scenario_server() -> Iterator[sink_server.DurableServer]:
    with sink_server.DurableServer(binary=require_binary("valkey-server")) as server:
        yield server


@pytest.fixture
def scenario_redis_url(_scenario_server: sink_server.DurableServer) -> str:
    """One durable Valkey for the scenario tests (both engines), emptied before each test."""
    with _scenario_server.client() as connection:
        connection.flushall()
    return _scenario_server.url
