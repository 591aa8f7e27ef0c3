"""The real-vLLM tier's servers keep their ZeroMQ IPC sockets in folders of their own, in the test run's temporary
folder: vLLM's default is the system temporary folder, where every socket a stopped server leaves behind stays."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from tests.helpers.vllm_server import VllmServer

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _bound_unix_paths() -> list[Path]:
    """The paths of every Unix socket bound on this machine (``/proc/net/unix``: the path is the eighth column)."""
    rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    return [Path(columns[7]) for columns in map(str.split, rows) if len(columns) > 7 and columns[7].startswith("/")]


def test_a_tier_server_binds_its_ipc_sockets_in_its_own_folder(vllm_chatml: VllmServer) -> None:
    if vllm_chatml.ipc_dir is None:  # STAGING_SINK_VLLM_REUSE (never set by scripts/test): not started by this run
        pytest.skip("the servers were started outside this run")
    bound = _bound_unix_paths()
    assert [path for path in bound if path.parent == vllm_chatml.ipc_dir], "vLLM did not take VLLM_RPC_BASE_PATH"
    system = Path(tempfile.gettempdir())
    assert vllm_chatml.ipc_dir.parent != system
    assert not [path for path in bound if path.parent == system and _UUID.fullmatch(path.name)]
