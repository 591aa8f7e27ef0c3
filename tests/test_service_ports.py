"""The ports tests hand to the services they start: no outgoing connection and no other pytest worker takes one
between the pick and the service's bind (a port from the kernel's ephemeral range once went to a connection of
the demo before Prometheus could bind it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.helpers import processes
from tests.helpers.processes import free_port


def _ephemeral_range() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_a_service_port_lies_below_the_ephemeral_range_and_is_not_handed_out_twice_in_a_row() -> None:
    ports = [free_port() for _ in range(50)]
    assert not set(ports) & set(_ephemeral_range()), ports
    assert len(set(ports)) == len(ports)
    assert all(port in processes._worker_slice() for port in ports)


def test_a_port_something_is_bound_to_is_skipped() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken_port = taken.getsockname()[1]
        for _ in range(len(processes._worker_slice()) + 1):
            assert free_port() != taken_port


def test_each_worker_picks_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    slices = []
    for worker in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
        processes._worker_slice.cache_clear()
        slices.append(set(processes._worker_slice()))
    processes._worker_slice.cache_clear()
    assert all(len(s) >= 100 for s in slices)
    assert sum(map(len, slices)) == len(set().union(*slices))
