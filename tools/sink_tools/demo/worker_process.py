"""The worker side of ``staging-sink demo``: one OS process that plays gate and inference worker.

For each of its rollouts the process runs a multi-turn agent conversation against the real pipeline:
the gate resolves the parent call through the :class:`~sink.ledger.redis.RedisCaptureLedger` and builds the
admission (contract §6.6), the inference worker begins the call through
:class:`~worker.capture.RolloutTokenCapture` (a ``staging_chain`` prefix is fetched from the
:class:`~sink.store.source.AsyncRedisStagingSource`), the :class:`~sink_tools.simulated.engine.SimulatedEngine` generates,
the capture stages the delta through the :class:`~sink.store.sink.AsyncRedisStagingSink` *before* the
response exists, the gate commits the ledger row, and at the end the framework calls
:func:`~sink.rollout.assembler.finished`. Planned retries, abandoned branches and injected capture failures make
the rollouts look like real agent traffic. This module is the demo's only bridge from ``sink`` into the
``worker`` package.

Progress goes to the parent process through a ``multiprocessing`` queue: ``("progress", index, counters)``
snapshots, then ``("done", index, report)`` or ``("error", index, message)``.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from sink.contract.packed_record import StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords, StageResult
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import finished
from sink.settings import ConnectionSettings
from sink.store.connection import Topology
from sink.store.pipeline_counters import pipeline_counters
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_tools.simulated.engine import SimulatedEngine
from worker.call import ActiveCall
from worker.capture import RolloutTokenCapture

__all__ = ("INJECTED_FAILURE_NOTE", "RolloutPlan", "WorkerConfig", "WorkerCounters", "worker_process_main")

INJECTED_FAILURE_NOTE = "injected capture failure (demo)"
_PROGRESS_INTERVAL_S = 0.2
_WEIGHT_VERSION = 0


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """What one rollout does: its turns, which of them are retried, branched or fail, and its reward."""

    rollout_id: str
    turns: int
    seed: int
    retry_turns: tuple[int, ...] = ()
    branch_turns: tuple[int, ...] = ()
    fail_turn: int | None = None
    reward: float = 0.0

    @property
    def calls(self) -> int:
        """Model calls the rollout issues: one per turn, plus one per retry and per branch."""
        return self.turns + len(self.retry_turns) + len(self.branch_turns)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs (picklable for the ``spawn`` start method)."""

    index: int
    url: str
    gate_url: str
    namespace: str
    cluster: bool
    shards: int
    max_tokens: int
    concurrency: int
    plans: tuple[RolloutPlan, ...]


@dataclass(slots=True)
class WorkerCounters:
    """What one worker process did so far (sent to the parent as a dict)."""

    calls: int = 0
    staged: int = 0
    stage_failures: int = 0
    capture_failures: int = 0
    uncaptured: int = 0
    committed: int = 0
    staged_tokens: int = 0
    rollouts_finished: int = 0
    latencies_ms: list[float] = field(default_factory=list)


class _TimedSink:
    """Wraps the sink to time each ``stage`` and count its durable acknowledgements."""

    def __init__(self, sink: AsyncRedisStagingSink, counters: WorkerCounters) -> None:
        self._sink = sink
        self._counters = counters

    async def stage(self, record: StageableRecord) -> StageResult:
        started = time.perf_counter()
        result = await self._sink.stage(record)
        self._counters.latencies_ms.append((time.perf_counter() - started) * 1000.0)
        if result.ok:
            self._counters.staged += 1
            self._counters.staged_tokens += record.delta_len
        else:
            self._counters.stage_failures += 1
        return result


@dataclass(frozen=True, slots=True)
class _Served:
    response_id: str
    response_items: list[dict[str, Any]]


def _turn_items(rollout_id: str, turn: int, branch: bool = False) -> list[dict[str, Any]]:
    if turn == 0:
        return [
            {"role": "system", "content": "You are a careful agent. Use tools."},
            {"role": "user", "content": f"Task {rollout_id}: summarise the sales data → a short report."},
        ]
    tag = f"turn {turn}{' (side branch)' if branch else ''}"
    if turn % 4 == 0:
        return [{"role": "user", "content": f"user follow-up, {tag}: continue, café →"}]
    return [{"role": "tool", "content": f"tool result, {tag}: {turn * 31 % 97} rows, größe ok"}]


class _RolloutDriver:
    """Gate + inference worker for the rollouts of one process."""

    def __init__(
        self,
        config: WorkerConfig,
        ledger: RedisCaptureLedger,
        capture: RolloutTokenCapture,
        counters: WorkerCounters,
        gate_client: Any,
    ) -> None:
        self._config = config
        self._gate = CaptureGate(ledger)
        self._capture = capture
        self._counters = counters
        self._gate_client = gate_client

    async def _commit(
        self,
        admission: CaptureAdmission,
        coords: CommitCoords,
        request_items: list[dict[str, Any]],
        served: _Served,
        admitted_at: float,
    ) -> None:
        """The gate's commit (contract §6.6): a failure row, or the custody row of the staged call."""
        row = await self._gate.commit(
            admission,
            coords,
            response_id=served.response_id,
            request_items=request_items,
            response_items=served.response_items,
            admitted_at=admitted_at,
        )
        if row is None:
            self._counters.capture_failures += 1
        else:
            self._counters.committed += 1

    async def _call(
        self,
        plan: RolloutPlan,
        engine: SimulatedEngine,
        number: int,
        history: list[dict[str, Any]],
        new_items: list[dict[str, Any]],
        *,
        fail: bool,
    ) -> _Served:
        """One model call: admit, begin, generate, stage (before the response exists), commit."""
        rollout_id, model_call_id = plan.rollout_id, f"c{number:03d}"
        request_items = history + new_items
        admitted_at = time.time()
        admission = await self._gate.admit(rollout_id, request_items, model_call_id=model_call_id)  # None: uncaptured
        render = engine.tokenizer.render_chat
        prompt = render(request_items)
        active: ActiveCall | None = None
        if admission is not None:
            active = await self._capture.abegin_call(admission)
            if admission.mode == "token_in" and not active.capture_failed:
                prompt = active.prefix_token_ids + render(new_items)
        # At least two tokens: an empty reply would be invisible to the lineage fingerprints (contract §6.4),
        # so its child could not tell it from its parent and would be poisoned as ambiguous.
        max_tokens = self._config.max_tokens
        generation = engine.generate(prompt, max_tokens, min_tokens=min(max_tokens, max(2, max_tokens // 4)))
        self._counters.calls += 1
        coords: CommitCoords | None = None
        if active is None:
            self._counters.uncaptured += 1
        elif fail:
            coords = self._capture.fail_call(active, reason=INJECTED_FAILURE_NOTE)
        else:
            coords = await self._capture.acomplete_call(
                active,
                prompt_token_ids=prompt,
                generated_token_ids=generation.token_ids,
                generated_logprobs=generation.logprobs,
            )
        # Only now does the response exist: the delta is already durable (or the call is poisoned).
        content = engine.tokenizer.decode(generation.token_ids)
        served = _Served(f"resp-{rollout_id}-{model_call_id}", [{"role": "assistant", "content": content}])
        if admission is not None and coords is not None:
            await self._commit(admission, coords, request_items, served, admitted_at)
        return served

    async def run_rollout(self, plan: RolloutPlan) -> None:
        """Drive *plan* to the end and announce it with ``finished()``."""
        engine = SimulatedEngine(plan.seed)
        history: list[dict[str, Any]] = []
        number = 0
        last: _Served | None = None
        for turn in range(plan.turns):
            new_items = _turn_items(plan.rollout_id, turn)
            if turn in plan.branch_turns and turn > 0:
                # An abandoned side branch from the current head: committed, never continued.
                await self._call(
                    plan, engine, number, history, _turn_items(plan.rollout_id, turn, branch=True), fail=False
                )
                number += 1
            if turn in plan.retry_turns:
                # The client gave up on this attempt and re-issued the same request.
                await self._call(plan, engine, number, history, new_items, fail=False)
                number += 1
            last = await self._call(plan, engine, number, history, new_items, fail=turn == plan.fail_turn)
            number += 1
            history = history + new_items + last.response_items
        assert last is not None
        await finished(
            self._gate_client,
            plan.rollout_id,
            reward=plan.reward,
            response={"id": last.response_id, "output": last.response_items},
            namespace=self._config.namespace,
            shards=self._config.shards,
        )
        self._counters.rollouts_finished += 1


def _snapshot(counters: WorkerCounters, *, with_latencies: bool) -> dict[str, Any]:
    values = asdict(counters)
    if not with_latencies:
        values.pop("latencies_ms")
    return values


async def _report_progress(config: WorkerConfig, counters: WorkerCounters, queue: Any) -> None:
    while True:
        queue.put(("progress", config.index, _snapshot(counters, with_latencies=False)))
        await anyio.sleep(_PROGRESS_INTERVAL_S)


async def _run_worker(config: WorkerConfig, queue: Any) -> None:
    counters = WorkerCounters()
    settings = ConnectionSettings(namespace=config.namespace, cluster=config.cluster)
    gate = Topology.from_url(config.gate_url, settings)
    try:
        async with (
            AsyncRedisStagingSink.from_url(config.url, namespace=config.namespace, cluster=config.cluster) as sink,
            AsyncRedisStagingSource.from_url(config.url, namespace=config.namespace, cluster=config.cluster) as source,
            RedisCaptureLedger(gate.client, settings) as ledger,
        ):
            await gate.initialize()
            capture = RolloutTokenCapture(
                sink=_TimedSink(sink, counters), weight_version_fn=lambda: _WEIGHT_VERSION, source=source
            )
            driver = _RolloutDriver(config, ledger, capture, counters, gate.client)
            limiter = anyio.CapacityLimiter(config.concurrency)

            async def run_one(plan: RolloutPlan) -> None:
                async with limiter:
                    await driver.run_rollout(plan)

            async with anyio.create_task_group() as progress:
                progress.start_soon(_report_progress, config, counters, queue)
                async with anyio.create_task_group() as rollouts:
                    for plan in config.plans:
                        rollouts.start_soon(run_one, plan)
                progress.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await gate.aclose()
    queue.put(
        ("done", config.index, {**_snapshot(counters, with_latencies=True), "metrics": pipeline_counters().snapshot()})
    )


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def worker_process_main(config: WorkerConfig, queue: Any) -> None:
    """Entry point of one demo worker process (``multiprocessing`` target, ``spawn`` start method).

    Exits with status 1 after reporting ``("error", index, message)`` when anything fails.
    """
    logging.basicConfig(level=logging.WARNING, format=f"worker {config.index}: %(levelname)s %(name)s: %(message)s")
    # The injected failures are the point of the demo; the summary reports them, so do not warn per call.
    logging.getLogger("worker.capture").setLevel(logging.ERROR)
    # Ctrl-C reaches the whole process group: the parent decides, and terminates the workers if it stops early.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        anyio.run(_run_worker, config, queue)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the process exits non-zero
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(130) from None
        queue.put(("error", config.index, _describe(exc)))
        raise SystemExit(1) from None
