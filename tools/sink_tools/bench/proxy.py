"""Benchmark: the capture proxy against the engine directly, a bare forwarding proxy and rLLM's model gateway
(``staging-sink bench proxy``).

One run, side by side, at 1, 16 and 64 concurrent clients, every call a 2,048-token chat completion (with
``--turns N``, each client runs N-turn rollouts: every call continues the previous one's conversation):

* ``direct``: client -> engine;
* ``bare``: client -> ``staging-sink proxy --no-capture`` -> engine (same server stack, no capture);
* ``capture``: client -> ``staging-sink proxy --prefix-mode verify`` -> engine, with durable staging before each
  response (the engine re-templates history; drift is detected);
* ``exact``: client -> ``staging-sink proxy --prefix-mode exact`` -> engine: render, generate from the spliced
  token ids, derender, then the same staging;
* ``gateway``: client -> rLLM's model gateway (``python -m rllm_model_gateway``, PyPI ``rllm-model-gateway``, an
  optional install) -> engine, each call's trace (its token ids and log-probs) written to SQLite after the reply
  (the gateway's default);
* ``gateway-sync``: the same with the gateway's ``sync_traces`` (set in its YAML ``--config``): the trace is
  written before the reply.

The gateway's calls go to its ``/sessions/{rollout}/v1/...`` URLs, so it records a trace of every call, and the
report counts them in its SQLite stores (a temporary directory) once the gateways have stopped. Without the
package, one line says the gateway paths were skipped and the others run as before.

Every path talks to the same engine in the same run: by default the simulated one (``staging-sink engine
--enable-scale-out``, one process); with ``--engine-url`` an engine already running there (a vLLM 0.32 started
with ``--enable-scale-out``, say; ``--model`` names its served model). The report names the engine. Engine and
proxies run as separate processes (no shared GIL with the load generator); the paths are interleaved in each of
``--repeats`` repeats and every figure is the best repeat's. The capturing proxies add a ``Server-Timing`` header
(``--server-timing``), so the report also gives the proxy's own share of each captured call (its time minus its
wait for the engine). The report also measures the sink's own stage p50 for the same records, and checks the
targets (:mod:`sink_tools.bench.proxy_report`). With ``--turns N`` (N >= 2, at most ``--calls-per-client``) each
captured call's own share is also recorded under its turn, and the report compares turn N's own p50 with turn 1's
(the root call) at the lowest client count, turn 2 (the first continuation) shown beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import anyio
import httpx
import orjson

from sink.contract.records import CaptureAdmission
from sink.server import DurableServer, free_port
from sink.store.sink import AsyncRedisStagingSink
from sink_tools.bench import BenchHelpFormatter, BenchmarkNamespaceInUseError, BenchNamespace, report_on_server
from sink_tools.bench.proxy_report import GATEWAY_PATHS, PathResult, format_report
from worker.capture import RolloutTokenCapture

__all__ = ("PathResult", "format_report", "gateway_skipped", "main", "server_timing")

_PATHS = ("direct", "bare", "capture", "exact")
_CAPTURED = frozenset({"capture", "exact"})
_GATEWAYS = frozenset(GATEWAY_PATHS)


def gateway_skipped() -> str | None:
    """The one line saying why the gateway paths are skipped (``rllm_model_gateway`` is not importable here, so
    ``python -m rllm_model_gateway`` would not start), or ``None`` when they run."""
    try:
        importlib.import_module("rllm_model_gateway")
    except ImportError as exc:
        return (
            f"gateway paths skipped: rllm_model_gateway is not importable ({exc}); "
            "pip install rllm-model-gateway to include them"
        )
    return None


def server_timing(value: str) -> tuple[float, float, float]:
    """``(engine_s, capture_s, total_s)`` of a proxy's ``Server-Timing`` value (:mod:`worker.proxy.call_timing`).

    :raises ValueError: the value lacks ``engine``, ``capture`` or ``total``.
    """
    durations = {}
    for metric in value.split(","):
        name, _, rest = metric.strip().partition(";")
        if rest.startswith("dur="):
            durations[name] = float(rest[4:]) / 1000
    try:
        return durations["engine"], durations["capture"], durations["total"]
    except KeyError as exc:
        raise ValueError(f"a Server-Timing header without {exc}: {value!r}") from exc


@contextlib.contextmanager
def _process(args: Sequence[str], health: str, module: str = "sink_cli") -> Iterator[None]:
    process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL)
    name = args[0] if module == "sink_cli" else module
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up")
            time.sleep(0.1)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


_JSON = {"content-type": "application/json"}


async def _drive(
    base: str, path: str, clients: int, calls: int, tokens: int, run: str, turns: int, model: str
) -> PathResult:
    latencies: list[float] = []
    engine_s: list[float] = []
    own_s: list[float] = []
    capture_s: list[float] = []
    own_turns: list[int] = []
    errors = 0

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        messages: list[dict[str, str]] = []
        rollout = ""
        for call in range(calls // clients):
            if call % turns == 0:
                rollout = f"{run}-{path}-{clients}-{index}-{call}"
                messages = [{"role": "user", "content": f"bench {index} {call}"}]
            prefix = f"/r/{rollout}" if path in _CAPTURED else f"/sessions/{rollout}" if path in _GATEWAYS else ""
            body = {"model": model, "messages": messages, "max_tokens": tokens, "min_tokens": tokens}
            started = time.perf_counter()
            response = await http.post(f"{base}{prefix}/v1/chat/completions", content=orjson.dumps(body), headers=_JSON)
            if response.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            if path in _CAPTURED:
                engine, capture, total = server_timing(response.headers.get("server-timing", ""))
                engine_s.append(engine)
                capture_s.append(capture)
                own_s.append(total - engine)
                own_turns.append(call % turns + 1)  # 1: the rollout's root call; later turns continue it
            answer = orjson.loads(response.content)
            if answer.get("prompt_token_ids") is not None:  # vLLM answers null when the fields were not asked for
                raise RuntimeError(f"{path}: token fields reached the client")
            reply = answer["choices"][0]["message"]["content"] or ""
            messages = [*messages, {"role": "assistant", "content": reply}, {"role": "tool", "content": "ok"}]

    async with contextlib.AsyncExitStack() as stack:
        # Each agent its own client and connection, as separate agent processes have: one pool shared by every agent
        # made this process the bottleneck (httpcore's pool walks all its connections for each waiting request).
        # Built before the clock starts (an httpx client takes ~17 ms to build).
        agents = [
            await stack.enter_async_context(httpx.AsyncClient(limits=httpx.Limits(max_connections=1), timeout=120))
            for _ in range(clients)
        ]
        warm = {"model": model, "messages": [{"role": "user", "content": "w"}], "max_tokens": 4}
        await agents[0].post(f"{base}/v1/chat/completions", json=warm)
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index, http in enumerate(agents):
                group.start_soon(client, index, http)
        seconds = time.perf_counter() - started
    return PathResult(path, clients, len(latencies), seconds, latencies, errors, engine_s, own_s, capture_s, own_turns)


async def _stage_p50_ms(url: str, namespace: str, tokens: int, samples: int, tag: str = "") -> float:
    """The sink's own stage latency p50 for one 2,048-token root record (sequential)."""
    durations: list[float] = []
    async with AsyncRedisStagingSink.from_url(url, namespace=namespace) as sink:
        capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
        for index in range(samples):
            admission = CaptureAdmission(rollout_id=f"stage{tag}-{index}", model_call_id="c", mode="text")
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


def _engine_version(url: str) -> str:
    """What the engine at *url* says it is (vLLM answers ``GET /version``), or ``""``."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        answer = httpx.get(f"{url}/version", timeout=5)
        if answer.status_code == 200:
            return f", version {answer.json().get('version')}"
    return ""


@contextlib.contextmanager
def _engine(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """The engine every path uses: ``(base URL, description for the report)``."""
    if args.engine_url:
        url = args.engine_url.rstrip("/")
        yield url, f"{url} (external, model {args.model!r}{_engine_version(url)})"
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(["engine", "--port", str(port), "--enable-scale-out"], f"{url}/health"):
        yield url, "the simulated engine (staging-sink engine --enable-scale-out: one process, one event loop)"


def _gateway_args(path: str, engine: str, port: int, store: Path) -> list[str]:
    """``rllm-model-gateway``'s arguments for *path*: one worker (the engine), its SQLite file in *store*; logging
    at ``warning`` (no access lines), as our proxies'."""
    args = ["--host", "127.0.0.1", "--port", str(port), "--worker", f"{engine}/v1", "--log-level", "warning"]
    args += ["--db-path", str(store / f"{path}.db")]
    if path == "gateway-sync":  # no flag or environment variable sets sync_traces: only the YAML config
        config = store / f"{path}.yaml"
        config.write_text("sync_traces: true\n")
        args += ["--config", str(config)]
    return args


def _gateway_traces(database: Path) -> tuple[int, int]:
    """``(traces, traces with completion token ids)`` in a gateway's SQLite file (none before its first trace)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
            query = "SELECT COUNT(*), SUM(json_array_length(data, '$.completion_token_ids') > 0) FROM traces"
            traces, with_ids = connection.execute(query).fetchone()
    except sqlite3.OperationalError:  # no file, or no table yet
        return 0, 0
    return traces, with_ids or 0


def _traces_note(results: Sequence[PathResult], store: Path) -> str:
    """The gateways' traces against their successful calls (after the gateways stopped: pending writes drained)."""
    counted, ok = [], True
    for path in GATEWAY_PATHS:
        calls = sum(result.calls for result in results if result.path == path)
        traces, with_ids = _gateway_traces(store / f"{path}.db")
        ok = ok and traces == calls == with_ids
        counted.append(f"{path} {traces} for {calls} calls ({with_ids} with token ids)")
    return f"gateway traces in SQLite: {', '.join(counted)} (one per call: {'ok' if ok else 'MISMATCH'})"


def _run(
    url: str, namespace: str, args: argparse.Namespace, paths: Sequence[str] = _PATHS
) -> tuple[list[PathResult], str, float, list[str]]:
    """Every path at every concurrency, ``--repeats`` times; returns the results, the engine, the best stage p50
    and the report's notes (the gateways' traces counted)."""
    ports = {path: free_port() for path in paths if path != "direct"}
    results: list[PathResult] = []
    stage_p50s: list[float] = []
    notes: list[str] = []
    run = uuid.uuid4().hex[:8]
    with _engine(args) as (engine, described), tempfile.TemporaryDirectory(prefix="stg-bench-gateway-") as store:
        bases = {"direct": engine, **{path: f"http://127.0.0.1:{port}" for path, port in ports.items()}}
        proxy = ["proxy", "--upstream", engine, "--redis-url", url, "--namespace", namespace]
        timed = [*proxy, "--server-timing"]
        proxies = {
            "bare": [*proxy, "--no-capture"],
            "capture": [*timed, "--prefix-mode", "verify"],
            "exact": [*timed, "--prefix-mode", "exact"],
        }
        with contextlib.ExitStack() as processes:
            for path, port in ports.items():
                health = f"{bases[path]}/health"
                if path in _GATEWAYS:
                    gateway = _gateway_args(path, engine, port, Path(store))
                    processes.enter_context(_process(gateway, health, module="rllm_model_gateway"))
                else:
                    processes.enter_context(_process([*proxies[path], "--port", str(port)], health))
            for repeat in range(args.repeats):  # interleaved: every path once per repeat, at every concurrency
                stage = partial(_stage_p50_ms, url, namespace, args.tokens, args.stage_samples, f"-{repeat}")
                stage_p50s.append(anyio.run(stage))  # the sink's own stage, in the same conditions
                for clients in args.clients:
                    calls = max(clients, args.calls_per_client * clients)
                    drive = partial(
                        _drive,
                        clients=clients,
                        calls=calls,
                        tokens=args.tokens,
                        run=f"{run}-{repeat}",
                        turns=args.turns,
                        model=args.model,
                    )
                    results.extend(anyio.run(partial(drive, bases[path], path)) for path in paths)
        if _GATEWAYS <= set(paths):
            notes.append(_traces_note(results, Path(store)))
    return results, described, min(stage_p50s), notes


def main(argv: Sequence[str] | None = None) -> int:
    """``staging-sink bench proxy [--clients 1 16 64] [--tokens 2048] [--calls-per-client N] [--turns N]
    [--repeats N] [--engine-url URL --model NAME] [--redis-url URL]``."""
    parser = argparse.ArgumentParser(
        prog="staging-sink bench proxy",
        description=__doc__,
        formatter_class=BenchHelpFormatter,
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="concurrent clients per run")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens generated per call")
    parser.add_argument("--calls-per-client", type=int, default=8, help="calls each client makes")
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="calls per rollout (each continues the previous one); from 2, the report adds the proxy's own share by turn",
    )
    parser.add_argument("--stage-samples", type=int, default=50, help="stage() calls timed per repeat (best p50)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; every figure is the best one's")
    parser.add_argument(
        "--engine-url",
        default=None,
        help="an engine already running there (vLLM 0.32 with --enable-scale-out) instead of the simulated one",
    )
    parser.add_argument("--model", default="simulated", help="the model name sent in every request")
    parser.add_argument("--redis-url", default=None, help="a durable server (default: a private one)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 1 <= args.turns <= max(1, args.calls_per_client):  # every client reaches the rollouts' last turn
        parser.error("--turns must be at least 1 and at most --calls-per-client")
    skipped = gateway_skipped()
    paths = _PATHS if skipped else (*_PATHS, *GATEWAY_PATHS)

    def run(url: str, _server: DurableServer | None) -> tuple[list[PathResult], str, float, list[str]]:
        # Every key goes under a fresh namespace of the benchmark's own, deleted at the end (also after an
        # error); a namespace that already has keys is refused, as for every benchmark (sink_tools.bench).
        space = BenchNamespace(url=url, namespace=f"stg-bench-proxy-{uuid.uuid4().hex[:8]}")
        if (found := anyio.run(space.first_key)) is not None:
            raise BenchmarkNamespaceInUseError(f"benchmark namespace {space.namespace!r} has a key: {found!r}")
        try:
            return _run(url, space.namespace, args, paths)
        finally:
            anyio.run(space.clear)

    def render(figures: tuple[list[PathResult], str, float, list[str]]) -> str:
        notes = [skipped, *figures[3]] if skipped else figures[3]
        return format_report(figures[0], figures[2], args.tokens, figures[1], notes=notes, turns=args.turns)

    return report_on_server(args.redis_url, run, render)


if __name__ == "__main__":
    sys.exit(main())
