"""A local Redis/Valkey Cluster of durable nodes, for tests and for trying cluster deployments.

``local_cluster()`` starts ``primaries * (1 + replicas_per_primary)`` nodes with
the durable configuration of :mod:`sink.server`, creates the cluster with the
server's own CLI (``valkey-cli --cluster create``) and waits until every slot
is served and every replica's link is up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from sink.errors import ServerProcessError
from sink.server import DurableServer, find_cli_binary, find_server_binary
from sink.store.connection import reply_text

__all__ = ("LocalCluster", "local_cluster")


class LocalCluster:
    """A running local Redis/Valkey Cluster: ``nodes`` are the :class:`DurableServer` handles (kill or pause
    one to test failover), ``startup_nodes`` their ``(host, port)`` pairs, ``url`` the first node's URL."""

    def __init__(self, nodes: list[DurableServer]) -> None:
        self.nodes = nodes
        self.startup_nodes = [(node.host, node.port) for node in nodes]
        self.url = nodes[0].url

    def _nodes_with_role(self, role: str) -> list[DurableServer]:
        found = []
        for node in self.nodes:
            if node.running and not node.paused:
                with node.client() as connection:
                    if connection.info("replication").get("role") == role:
                        found.append(node)
        return found

    def primaries(self) -> list[DurableServer]:
        """The running nodes that are primaries right now (asks each node)."""
        return self._nodes_with_role("master")

    def replicas(self) -> list[DurableServer]:
        """The running nodes that are replicas right now (asks each node)."""
        return self._nodes_with_role("slave")

    def heal(self, *, timeout_s: float = 60.0) -> None:
        """Resume paused nodes, restart killed ones (they rejoin from their ``nodes.conf``) and wait until
        the cluster is healthy again. Tests that break the shared cluster call this before they finish.

        :raises ServerProcessError: when a node does not come back or the cluster does not heal.
        """
        for node in self.nodes:
            node.resume()
            if not node.running:
                node.restart()
        self.wait_healthy(timeout_s=timeout_s)

    def wait_healthy(self, *, timeout_s: float = 60.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` with all 16384 slots served, knows
        every node, and every replica's link to its primary is up.

        :raises ServerProcessError: when that does not happen within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem = self._health_problem()
            if not problem:
                return
            time.sleep(0.1)
        raise ServerProcessError(f"cluster not healthy within {timeout_s}s: {problem}")

    def _health_problem(self) -> str:
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with node.client() as connection:
                    raw = connection.execute_command("CLUSTER", "INFO")
                    replication = connection.info("replication")
            except redis.RedisError as exc:
                return f"node {node.port}: {exc}"
            text = reply_text(raw, "CLUSTER INFO reply")
            info = dict(line.split(":", 1) for line in text.split() if ":" in line)
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                return f"node {node.port}: state {info.get('cluster_state')}, slots ok {info.get('cluster_slots_ok')}"
            if int(info.get("cluster_known_nodes", 0)) < len(self.nodes):
                return f"node {node.port} knows {info.get('cluster_known_nodes')} of {len(self.nodes)} nodes"
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return f"replica {node.port}: link to its primary is {replication.get('master_link_status')}"
        return ""


@contextmanager
def local_cluster(
    *, primaries: int = 3, replicas_per_primary: int = 1, binary: str | os.PathLike[str] | None = None
) -> Iterator[LocalCluster]:
    """Run a local cluster of durable nodes (``cluster-node-timeout 2000``) for the ``with`` block, created
    with the server's own CLI, and wait until it is healthy (see :meth:`LocalCluster.wait_healthy`).

    :raises ServerNotFoundError: when no server binary or CLI is installed.
    :raises ServerProcessError: when a node does not come up or the cluster does not form.
    """
    resolved = find_server_binary(binary)
    cli = find_cli_binary(resolved)
    root = Path(tempfile.mkdtemp(prefix="staging-sink-cluster-"))
    nodes: list[DurableServer] = []
    try:
        for index in range(primaries * (1 + replicas_per_primary)):
            node = DurableServer(
                binary=resolved,
                data_dir=root / f"node{index}",
                cluster_enabled=True,
                # Replicas sync at once instead of waiting for more replicas to batch with (default 5 s).
                extra_config={"repl-diskless-sync-delay": "0"},
            )
            nodes.append(node)
            node.start()
        command = [os.fspath(cli), "--cluster", "create", *(f"{node.host}:{node.port}" for node in nodes)]
        command += ["--cluster-replicas", str(replicas_per_primary), "--cluster-yes"]
        created = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if created.returncode != 0:
            raise ServerProcessError(f"{' '.join(command)} failed:\n{created.stdout}\n{created.stderr}")
        cluster = LocalCluster(nodes)
        cluster.wait_healthy()
        yield cluster
    finally:
        for node in nodes:
            node.kill()  # throwaway data: no clean shutdown needed, and replicas make it slow
        shutil.rmtree(root, ignore_errors=True)
