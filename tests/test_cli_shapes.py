"""Errors and output shapes of the operator commands: one line naming a missing extra (``parquet``), JSON with real types, a
distinct exit code for a port that cannot be bound, the read-only ``ops`` role running ``prune --dry-run``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sink_cli.common import EXIT_CANNOT_LISTEN, EXIT_UNREACHABLE
from sink_cli.main import main
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.e2e import stage_rollouts
from tests.helpers.trainer import publish

ROOT = Path(__file__).resolve().parents[1]
# Runs the CLI with pyarrow unimportable (as in an install without the parquet extra).
NO_PYARROW = "import sys; sys.modules['pyarrow'] = None; from sink_cli.main import main; sys.exit(main(sys.argv[1:]))"


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """*code* run with *args* by this interpreter, from the root of this tree (its packages come first)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_parquet_export_without_pyarrow_prints_one_line_naming_the_extra(redis_url: str, tmp_path: Path) -> None:
    anyio.run(lambda: publish(redis_url, ["pq-0"], calls=2))
    out = tmp_path / "rows.parquet"
    result = _run(NO_PYARROW, "export", "pq-0", "--format", "parquet", "-o", str(out), "--redis-url", redis_url)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("staging-sink: error: ") and "[parquet]" in lines[0] and "pyarrow" in lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_jsonl_export_carries_the_receipt_as_an_object(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(lambda: publish(redis_url, ["js-0"], calls=2, rewards={"js-0": 0.25}))
    assert main(["export", "js-0", "--redis-url", redis_url]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    row = json.loads(line)
    assert isinstance(row["receipt"], dict), type(row["receipt"])
    assert row["receipt"]["rollout_id"] == "js-0" and row["receipt"]["reward"] == 0.25


def test_inspect_json_prints_numbers_as_numbers(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(lambda: stage_rollouts(redis_url, ["num-0"], calls=2, n_tokens=8))
    assert main(["inspect", "num-0", "--json", "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out)
    first, second = report["calls"]
    for name in ("prev_len", "delta_len", "cum_len", "weight", "bytes"):
        assert type(first[name]) is int and type(second[name]) is int, (name, first[name])
    assert first["prev_len"] == 0 and second["prev_len"] == first["cum_len"]
    assert isinstance(first["call"], str) and isinstance(first["entry_id"], str)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_proxy_that_cannot_bind_its_port_exits_with_its_own_code(busy_port: int, workers: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sink_cli",
            "proxy",
            "--no-capture",
            "--upstream",
            "http://127.0.0.1:9",
            "--port",
            str(busy_port),
            "--workers",
            workers,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert EXIT_CANNOT_LISTEN not in (0, 1, 2, EXIT_UNREACHABLE)
    assert result.returncode == EXIT_CANNOT_LISTEN, result.stderr
    assert f"cannot listen on 127.0.0.1:{busy_port}" in result.stderr and "Traceback" not in result.stderr


def test_engine_that_cannot_bind_its_port_exits_with_the_same_code(busy_port: int) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sink_cli", "engine", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_CANNOT_LISTEN, result.stderr


@pytest.fixture(scope="module")
def acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("acl-prune"))
    with server:
        yield server


def test_the_read_only_ops_role_can_run_prune_dry_run(
    acl_server: AclServer, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_url = acl_server.role_url("admin")
    anyio.run(lambda: publish(admin_url, ["ops-0"], calls=2))
    anyio.run(lambda: stage_rollouts(admin_url, ["ops-live"], calls=1))
    with acl_server.client() as admin:
        keys_before = sorted(admin.keys("stg:*"))
    code = main(["prune", "--dry-run", "--json", "--redis-url", acl_server.role_url("ops")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["dry_run"] is True
    with acl_server.client() as admin:
        assert sorted(admin.keys("stg:*")) == keys_before  # a dry run changes nothing
    # Writing is still refused to ops: the role stays read-only.
    assert main(["prune", "--redis-url", acl_server.role_url("ops")]) != 0
