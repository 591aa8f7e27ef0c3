"""``staging-sink engine`` and ``staging-sink proxy`` as real processes: two proxy processes (one of them with
``--workers 2``) serve one rollout's calls alternately and produce one valid chain."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sink_cli.main import main
from tests.helpers.commands import staging_sink
from tests.helpers.processes import free_port, service
from tests.helpers.proxy import close_clients, finish, manifest, pull, run_agent

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    """Every openai client of the test is closed at its end."""
    yield
    close_clients()


@pytest.mark.slow
def test_two_proxy_processes_one_chain(redis_url: str) -> None:
    engine_port, one_port, two_port = free_port(), free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    proxy = ("proxy", "--upstream", engine, "--redis-url", redis_url)
    with (
        service("engine", "--port", str(engine_port), "--seed", "5", health=f"{engine}/health"),
        service(*proxy, "--port", str(one_port), health=f"http://127.0.0.1:{one_port}/health"),
        service(*proxy, "--port", str(two_port), "--workers", "2", health=f"http://127.0.0.1:{two_port}/health"),
    ):
        bases = [f"http://127.0.0.1:{one_port}", f"http://127.0.0.1:{two_port}"]
        _, last_id = run_agent(bases, "cli-1", turns=4)
        finish(bases[1], "cli-1", 1.0, last_id)
        metrics = httpx.get(f"{bases[0]}/staging-sink/metrics").text
    shown = manifest(redis_url, "cli-1")
    assert len(shown.records) == 4 and not shown.failures
    assert [r.parent_call_id for r in shown.records][1:] == [r.model_call_id for r in shown.records][:-1]
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None
    assert 'staging_proxy_calls_total{outcome="captured"} 2.0' in metrics


def test_proxy_needs_a_redis_url(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGING_SINK_REDIS_URL", raising=False)
    assert main(["proxy", "--upstream", "http://127.0.0.1:1"]) == 2
    assert "needs --redis-url" in capsys.readouterr().err


def test_proxy_settings_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["proxy", "--upstream", "http://127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1"]
    assert main([*argv, "--weight-version", "-1"]) == 2
    assert "weight_version" in capsys.readouterr().err


def test_the_cli_works_without_the_proxy_extra() -> None:
    """A clone installed without the ``proxy`` extra still runs every other command; proxy/engine say what is missing."""
    script = (
        "import sys\n"
        "for name in ('orjson', 'httpx', 'uvicorn', 'openai'): sys.modules[name] = None\n"
        "from sink_cli.main import main\n"
        "sys.exit(main(['engine']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "install the proxy extra" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_exact_prefix_mode_as_processes(redis_url: str) -> None:
    # --prefix-mode exact refuses to start unless the engine serves the token-in/token-out routes.
    engine_port, proxy_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    proxy = ("proxy", "--upstream", engine, "--redis-url", redis_url, "--prefix-mode", "exact")
    with (
        service("engine", "--port", str(engine_port), "--enable-scale-out", health=f"{engine}/health"),
        service(
            *proxy,
            "--port",
            str(proxy_port),
            "--weight-source",
            "engine",
            "--weight-version",
            "3",
            health=f"http://127.0.0.1:{proxy_port}/health",
        ),
    ):
        base = f"http://127.0.0.1:{proxy_port}"
        _, last_id = run_agent([base], "cli-exact", turns=3)
        finish(base, "cli-exact", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and pulled.row.weight_versions == (3, 3, 3)


def test_exact_mode_refuses_an_engine_without_the_routes(redis_url: str) -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    with service("engine", "--port", str(engine_port), health=f"{engine}/health"):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "sink_cli",
                "proxy",
                "--upstream",
                engine,
                "--redis-url",
                redis_url,
                "--prefix-mode",
                "exact",
                "--port",
                str(proxy_port),
            ],
            check=False,
            cwd=ROOT,
            capture_output=True,
            timeout=60,
        )
    # A configuration refusal: the usage code and one line (not uvicorn's exit 3, "unreachable", with a traceback).
    assert result.returncode == 2, result.stderr
    refusal = [line for line in result.stderr.decode().splitlines() if line.startswith("staging-sink: error:")]
    assert len(refusal) == 1 and "--enable-scale-out" in refusal[0], result.stderr
    assert b"Traceback" not in result.stderr


def test_the_proxy_says_its_prefix_mode_at_start_without_verbose(redis_url: str) -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    with (
        service("engine", "--port", str(engine_port), "--enable-scale-out", health=f"{engine}/health"),
        staging_sink("proxy", "--upstream", engine, "--redis-url", redis_url, "--port", str(proxy_port)) as proxy,
    ):
        line = proxy.wait_for(r"prefix mode: ")
    assert "prefix mode: exact (" in line and "end-of-turn ids [2]" in line
