"""The monitoring profile end to end: deploy/prometheus scrapes every service of docker-compose.yml that serves
metrics, and after a demo through the capture proxy every Grafana panel's query returns data from a real
Prometheus (the Debian ``prometheus`` package; scripts/test installs it) scraping real services."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from sink.keys import done_stream
from tests.helpers.processes import free_port, service, wait_for
from tests.helpers.proxy import close_clients, finish, run_agent
from tests.test_dashboard import COMPOSE, PROMETHEUS, _expressions

SERVED = {"assembler", "trainer", "metrics", "capture-proxy"}
"""The compose services that serve metrics (each must be scraped)."""


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _yaml(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _served() -> dict[str, tuple[str, str]]:
    """compose target (``service:port``) -> (metrics path, service) of every service serving metrics."""
    served: dict[str, tuple[str, str]] = {}
    for name, spec in _yaml(COMPOSE)["services"].items():
        command = [str(word) for word in spec.get("command") or []]
        if command[:1] != ["staging-sink"]:
            continue
        if "--metrics-port" in command:
            served[f"{name}:{command[command.index('--metrics-port') + 1]}"] = ("/metrics", name)
        elif command[1] == "metrics":
            served[f"{name}:{command[command.index('--port') + 1]}"] = ("/metrics", name)
        elif command[1] == "proxy":
            served[f"{name}:{command[command.index('--port') + 1]}"] = ("/staging-sink/metrics", name)
    return served


def _scraped() -> dict[str, str]:
    """Prometheus target -> metrics path, from deploy/prometheus/prometheus.yml."""
    return {
        target: job.get("metrics_path", "/metrics")
        for job in _yaml(PROMETHEUS)["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }


def test_prometheus_scrapes_every_service_that_serves_metrics() -> None:
    served = _served()
    assert {service_name for _path, service_name in served.values()} == SERVED
    scraped = _scraped()
    for target, (path, _name) in served.items():
        assert scraped.get(target) == path, (target, path, scraped)


def _prometheus_config(ports: dict[str, int]) -> dict[str, Any]:
    """deploy's scrape jobs, every compose target pointed at the local process, scraped every second."""
    config = _yaml(PROMETHEUS)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            group["targets"] = [f"127.0.0.1:{ports[target.split(':')[0]]}" for target in group["targets"]]
    return config


def _query(base: str, expr: str) -> list[Any]:
    answer = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    result: list[Any] = answer["data"]["result"]
    return result


def _demo(redis_url: str, proxy: str) -> None:
    """What the demo does, through the capture proxy: rollouts staged, finished and trained; one with a corrupted
    record (a verification failure) and one malformed done event (a dead letter)."""
    for index in range(4):
        _, last_id = run_agent([proxy], f"mon-{index}", turns=3)
        finish(proxy, f"mon-{index}", float(index % 2), last_id)
    _, last_id = run_agent([proxy], "mon-bad", turns=2)
    with redis.Redis.from_url(redis_url) as client:
        key = min(client.scan_iter(match="stg:{mon-bad}:rec:*", count=1000))
        blob = client.get(key)
        assert isinstance(blob, bytes)
        client.set(key, blob[:-2] + b"\x00\x00")
        client.xadd(done_stream("stg", 0), {"junk": "not a done event"})
    finish(proxy, "mon-bad", 0.0, last_id)


@pytest.mark.slow
def test_every_dashboard_panel_has_data_after_the_demo(redis_url: str, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no prometheus on PATH: scripts/test installs it (apt-get install --no-install-recommends prometheus)")
    names = ("assembler", "trainer", "metrics", "capture-proxy", "engine", "prometheus")
    ports = {name: free_port() for name in names}
    redis_args = ("--redis-url", redis_url)

    def local(name: str, path: str = "/metrics") -> str:
        return f"http://127.0.0.1:{ports[name]}{path}"

    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(_prometheus_config(ports)))
    with ExitStack() as stack:
        for argv, health in (
            (("assembler", *redis_args, "--metrics-port", str(ports["assembler"])), local("assembler")),
            (("trainer", *redis_args, "--metrics-port", str(ports["trainer"])), local("trainer")),
            (("metrics", *redis_args, "--port", str(ports["metrics"]), "--interval-s", "0.5"), local("metrics")),
            (("engine", "--port", str(ports["engine"])), local("engine", "/health")),
            (
                (
                    "proxy", "--upstream", local("engine", ""), *redis_args, "--port", str(ports["capture-proxy"]),
                    "--workers", "2",
                ),
                local("capture-proxy", "/health"),
            ),
        ):  # fmt: skip
            stack.enter_context(service(*argv, health=health))
        _demo(redis_url, local("capture-proxy", ""))
        prometheus = local("prometheus", "")
        stack.enter_context(
            service(
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                "--log.level=warn",
                health=f"{prometheus}/-/ready",
                module=False,
            )
        )
        panels: dict[str, list[str]] = {}
        for title, expr in _expressions():
            panels.setdefault(title, []).append(expr.replace("$__rate_interval", "30s").replace("$__range", "5m"))
        empty: dict[str, list[str]] = {}

        def every_panel_has_data() -> bool:
            empty.clear()
            for title, exprs in panels.items():
                if not any(_query(prometheus, expr) for expr in exprs):
                    empty[title] = exprs
            return not empty

        wait_for(every_panel_has_data, f"panels without data: {empty}", timeout_s=90)
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        assert len(targets) == len(_served()) and all(t["health"] == "up" for t in targets), targets
        # The proxy's stage series reach Prometheus summed over its workers: one series per result, not per pid.
        stages = _query(prometheus, 'staging_sink_stages_total{job="staging-sink-proxy",result="ok"}')
        assert len(stages) == 1 and float(stages[0]["value"][1]) == 4 * 3 + 2
