"""Benchmark: the capture proxy against the engine directly and a bare forwarding proxy (``staging-sink bench proxy``).

One run, side by side, at 1, 16 and 64 concurrent clients, every call a 2,048-token chat completion (with
``--turns N``, each client runs N-turn rollouts: every call continues the previous one's conversation):

* ``direct``: client -> engine (``staging-sink engine --enable-scale-out``);
* ``bare``: client -> ``staging-sink proxy --no-capture`` -> engine (same server stack, no capture);
* ``capture``: client -> ``staging-sink proxy --prefix-mode verify`` -> engine, with durable staging before each
  response (the engine re-templates history; drift is detected);
* ``exact``: client -> ``staging-sink proxy --prefix-mode exact`` -> engine: render, generate from the spliced
  token ids, derender, then the same staging.

Engine and proxies run as separate processes (no shared GIL with the load generator). The report also measures
the sink's own stage p50 for the same 2,048-token records, and checks the targets: capture >= 0.5x bare calls/s at
16 clients, and capture's added p50 over bare <= the stage p50 + 1 ms (at 1 client).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import httpx
import orjson

from sink.bench import BenchHelpFormatter, BenchNamespace, report_on_server
from sink.contract.records import CaptureAdmission
from sink.errors import BenchmarkNamespaceInUseError
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from worker.capture import RolloutTokenCapture

__all__ = ("PathResult", "format_report", "main")

_PATHS = ("direct", "bare", "capture", "exact")
_CAPTURED = frozenset({"capture", "exact"})


@dataclass(frozen=True)
class PathResult:
    """One path at one concurrency."""

    path: str
    clients: int
    calls: int
    seconds: float
    latencies_s: list[float]
    errors: int = 0

    @property
    def calls_per_s(self) -> float:
        """Throughput."""
        return self.calls / self.seconds

    def percentile_ms(self, q: float) -> float:
        """Latency percentile *q* (0-100) in ms."""
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def _process(args: Sequence[str], health: str) -> Iterator[None]:
    process = subprocess.Popen([sys.executable, "-m", "sink", *args], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not come up")
            time.sleep(0.1)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


async def _drive(base: str, path: str, clients: int, calls: int, tokens: int, run: str, turns: int) -> PathResult:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        messages: list[dict[str, str]] = []
        rollout = ""
        for call in range(calls // clients):
            if call % turns == 0:
                rollout = f"{run}-{path}-{clients}-{index}-{call}"
                messages = [{"role": "user", "content": f"bench {index} {call}"}]
            prefix = f"/r/{rollout}" if path in _CAPTURED else ""
            body = {"model": "simulated", "messages": messages, "max_tokens": tokens, "min_tokens": tokens}
            started = time.perf_counter()
            response = await http.post(f"{base}{prefix}/v1/chat/completions", content=orjson.dumps(body))
            if response.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            answer = orjson.loads(response.content)
            if "prompt_token_ids" in answer:
                raise RuntimeError(f"{path}: token fields reached the client")
            reply = answer["choices"][0]["message"]["content"] or ""
            messages = [*messages, {"role": "assistant", "content": reply}, {"role": "tool", "content": "ok"}]

    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        await http.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w"}]})
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index in range(clients):
                group.start_soon(client, index, http)
        seconds = time.perf_counter() - started
    return PathResult(path, clients, len(latencies), seconds, latencies, errors)


async def _stage_p50_ms(url: str, namespace: str, tokens: int, samples: int) -> float:
    """The sink's own stage latency p50 for one 2,048-token root record (sequential)."""
    durations: list[float] = []
    async with AsyncRedisStagingSink.from_url(url, namespace=namespace) as sink:
        capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
        for index in range(samples):
            admission = CaptureAdmission(rollout_id=f"stage-{index}", model_call_id="c", mode="text")
            call = await capture.abegin_call(admission)
            ids = list(range(16, 16 + tokens))
            record_started = time.perf_counter()
            coords = await capture.acomplete_call(
                call, prompt_token_ids=[1, 2, 3], generated_token_ids=ids, generated_logprobs=[-0.5] * tokens
            )
            durations.append(time.perf_counter() - record_started)
            if coords.disposition != "staged":
                raise RuntimeError("stage failed: is the server durable?")
    return 1000 * statistics.median(durations)


def format_report(results: list[PathResult], stage_p50_ms: float, tokens: int) -> str:
    """The side-by-side table and the target checks."""
    lines = [
        f"proxy benchmark: {tokens}-token chat completions; sink stage p50 {stage_p50_ms:.2f} ms",
        f"{'clients':>7} {'path':>8} {'calls':>6} {'errors':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    by_key = {(r.path, r.clients): r for r in results}
    lines.extend(
        f"{r.clients:>7} {r.path:>8} {r.calls:>6} {r.errors:>6} {r.calls_per_s:>9.1f} "
        f"{r.percentile_ms(50):>8.2f} {r.percentile_ms(99):>8.2f}"
        for r in results
    )
    if ("capture", 16) in by_key and ("bare", 16) in by_key:
        ratio = by_key[("capture", 16)].calls_per_s / by_key[("bare", 16)].calls_per_s
        verdict = "ok" if ratio >= 0.5 else "MISSED"
        lines.append(f"capture/bare calls/s at 16 clients: {ratio:.2f} (target >= 0.5: {verdict})")
    if ("capture", 1) in by_key and ("bare", 1) in by_key:
        added = by_key[("capture", 1)].percentile_ms(50) - by_key[("bare", 1)].percentile_ms(50)
        verdict = "ok" if added <= stage_p50_ms + 1 else "MISSED"
        lines.append(f"added p50 at 1 client: {added:.2f} ms (target <= {stage_p50_ms + 1:.2f} ms: {verdict})")
    for clients in sorted({r.clients for r in results}):
        keys = [("direct", clients), ("capture", clients), ("exact", clients)]
        if all(key in by_key for key in keys):
            direct, verify, exact = (by_key[key] for key in keys)
            verify_p50, verify_p99, exact_p50, exact_p99 = (
                path.percentile_ms(q) - direct.percentile_ms(q) for path in (verify, exact) for q in (50, 99)
            )
            ratio = exact_p50 / verify_p50 if verify_p50 > 0 else float("inf")
            verdict = "ok" if ratio <= 1.5 else "MISSED"
            lines.append(
                f"added over direct at {clients} clients: verify p50 {verify_p50:.2f} / p99 {verify_p99:.2f} ms, "
                f"exact p50 {exact_p50:.2f} / p99 {exact_p99:.2f} ms; exact/verify p50 {ratio:.2f} "
                f"(target <= 1.5: {verdict})"
            )
    return "\n".join(lines)


def _run(url: str, namespace: str, args: argparse.Namespace) -> list[PathResult]:
    engine_port, bare_port, capture_port, exact_port = _free_port(), _free_port(), _free_port(), _free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    bases = {
        "direct": engine,
        "bare": f"http://127.0.0.1:{bare_port}",
        "capture": f"http://127.0.0.1:{capture_port}",
        "exact": f"http://127.0.0.1:{exact_port}",
    }
    proxy = ["proxy", "--upstream", engine, "--redis-url", url, "--namespace", namespace]
    results: list[PathResult] = []
    run = uuid.uuid4().hex[:8]
    with (
        _process(["engine", "--port", str(engine_port), "--enable-scale-out"], f"{engine}/health"),
        _process([*proxy, "--no-capture", "--port", str(bare_port)], f"{bases['bare']}/health"),
        _process([*proxy, "--prefix-mode", "verify", "--port", str(capture_port)], f"{bases['capture']}/health"),
        _process([*proxy, "--prefix-mode", "exact", "--port", str(exact_port)], f"{bases['exact']}/health"),
    ):
        for clients in args.clients:
            calls = max(clients, args.calls_per_client * clients)
            drive = partial(_drive, clients=clients, calls=calls, tokens=args.tokens, run=run, turns=args.turns)
            results.extend(anyio.run(partial(drive, bases[path], path)) for path in _PATHS)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``staging-sink bench proxy [--clients 1 16 64] [--tokens 2048] [--calls-per-client N] [--turns N]
    [--redis-url URL]``."""
    parser = argparse.ArgumentParser(
        prog="staging-sink bench proxy",
        description=__doc__,
        formatter_class=BenchHelpFormatter,
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="concurrent clients per run")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens generated per call")
    parser.add_argument("--calls-per-client", type=int, default=8, help="calls each client makes")
    parser.add_argument("--turns", type=int, default=1, help="calls per rollout (each continues the previous one)")
    parser.add_argument("--stage-samples", type=int, default=50, help="stage() calls timed for the stage p50")
    parser.add_argument("--redis-url", default=None, help="a durable server (default: a private one)")
    args = parser.parse_args(argv)

    def run(url: str, _server: DurableServer | None) -> tuple[list[PathResult], float]:
        # Every key goes under a fresh namespace of the benchmark's own, deleted at the end (also after an
        # error); a namespace that already has keys is refused, as for every benchmark (sink.bench).
        space = BenchNamespace(url=url, namespace=f"stg-bench-proxy-{uuid.uuid4().hex[:8]}")
        if (found := anyio.run(space.first_key)) is not None:
            raise BenchmarkNamespaceInUseError(f"benchmark namespace {space.namespace!r} has a key: {found!r}")
        try:
            stage_p50 = anyio.run(_stage_p50_ms, url, space.namespace, args.tokens, args.stage_samples)
            return _run(url, space.namespace, args), stage_p50
        finally:
            anyio.run(space.clear)

    return report_on_server(args.redis_url, run, lambda figures: format_report(figures[0], figures[1], args.tokens))


if __name__ == "__main__":
    sys.exit(main())
