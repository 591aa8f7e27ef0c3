"""The PyTorch data pipeline (torch extra) on a real server: a tiny model trains on pulled rows, acknowledgement
is explicit, every DataLoader worker and rank reads under its own consumer name, and the core never imports
torch."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
import redis
import torch
from torch.utils.data import DataLoader

from sink.errors import BatchInputError
from sink.keys import receipts_stream
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import DEFAULT_SHARDS, ReaderSettings
from sink.trainer.reader.backlog import TRAINER_GROUP
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.torch_data import StagedRolloutDataset, TorchBatch, _Termination
from tests.helpers.e2e import pull_until, stage_rollouts
from tests.helpers.trainer import publish, publish_staged

VOCAB = 64
AN_HOUR_MS = 3_600_000  # claim_idle_ms of the stall tests: a wait for a lease to expire times the test out
BATCH_TIMEOUT_S = 30  # the DataLoader's deadline for any one batch, far below a lease
WORKER_WARNING = "WORKER-WARNING"
# torch's advice on machines with fewer cores than workers (the 2-core CI machine): not what these tests check.
MORE_WORKERS_THAN_CORES = "ignore:This DataLoader will create:UserWarning"


def _receipts_left(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(int(client.xlen(receipts_stream("stg", shard))) for shard in range(DEFAULT_SHARDS))


def _pending(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        streams = [receipts_stream("stg", shard) for shard in range(DEFAULT_SHARDS)]
        return sum(int(client.xpending(stream, TRAINER_GROUP)["pending"]) for stream in streams if client.exists(stream))


def _worker_warnings_to_stderr(worker_id: int) -> None:
    """A DataLoader worker's sink warnings go to its stderr (captured by ``capfd``), whatever the start method."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"{WORKER_WARNING} worker {worker_id} %(name)s: %(message)s"))
    logging.getLogger("sink").addHandler(handler)


def test_importing_the_core_does_not_import_torch() -> None:
    code = (
        "import sys, sink, sink.trainer.reader.sync_reader, sink.trainer.batch, sink.trainer.packing, sink_cli.dispatch, worker;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def _publish(url: str, ids: list[str], *, receipt_shards: int = DEFAULT_SHARDS) -> dict[str, list[int]]:
    staged = anyio.run(lambda: publish(url, ids, calls=2, n_tokens=6, receipt_shards=receipt_shards))
    return {rollout_id: s.token_ids for rollout_id, s in staged.items()}


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids % VOCAB))  # type: ignore[no-any-return]


def _loss(model: TinyPolicy, batch: TorchBatch) -> torch.Tensor:
    """Next-token loss on the generated tokens (loss_mask), a stand-in for the policy-gradient loss."""
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    targets = (ids[:, 1:] % VOCAB).reshape(-1)
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets, reduction="none")
    mask = batch["loss_mask"][:, 1:].reshape(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def test_a_tiny_model_trains_on_pulled_rows_and_acks_only_when_asked(redis_url: str) -> None:
    ids = [f"torch-{i}" for i in range(8)]
    tokens = _publish(redis_url, ids)
    dataset = StagedRolloutDataset(redis_url, rollouts_per_batch=4, max_batches=2, block_ms=200, consumer_prefix="t")
    loader = DataLoader(dataset, batch_size=None)
    torch.manual_seed(0)
    model = TinyPolicy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[str] = []
    losses: list[float] = []
    for batch in loader:
        assert isinstance(batch, TorchBatch) and batch.worker_id is None
        assert batch.consumer_name == "t-rank0-workermain"
        assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        for index, rollout_id in enumerate(batch.rollout_ids):  # the exact staged tokens, as tensors
            n = len(tokens[rollout_id])
            assert batch["input_ids"][index, :n].tolist() == tokens[rollout_id]
            assert int(batch["input_lengths"][index]) == n
        pending_before = _receipts_left(redis_url)
        loss = _loss(model, batch)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        assert _receipts_left(redis_url) == pending_before  # iterating and stepping acknowledged nothing
        dataset.ack(batch)
        assert _receipts_left(redis_url) == pending_before - len(batch.ack_ids)
        losses.append(float(loss.detach()))
        seen += batch.rollout_ids
    assert sorted(seen) == sorted(ids)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained
    assert _receipts_left(redis_url) == 0


def test_packed_batches_carry_cu_seqlens_and_segments(redis_url: str) -> None:
    ids = [f"pack-{i}" for i in range(4)]
    tokens = _publish(redis_url, ids)
    longest = max(len(t) for t in tokens.values())
    dataset = StagedRolloutDataset(
        redis_url, rollouts_per_batch=4, mode="pack", max_tokens=2 * longest, max_batches=1, block_ms=200
    )
    seen: list[str] = []
    for batch in DataLoader(dataset, batch_size=None):
        assert batch["input_ids"].shape[1] == 2 * longest
        assert len(batch.cu_seqlens) == batch["input_ids"].shape[0]
        assert int(sum(int(c[-1]) for c in batch.cu_seqlens)) == int(batch["input_lengths"].sum())
        assert int((batch["segment_ids"] >= 0).sum()) == int(batch["input_lengths"].sum())
        dataset.ack(batch)
        seen += batch.rollout_ids
    assert len(seen) >= 1 and _receipts_left(redis_url) == len(ids) - len(seen)


def test_every_dataloader_worker_reads_under_its_own_consumer_and_acks_through_its_queue(redis_url: str) -> None:
    ids = [f"worker-{i}" for i in range(8)]
    # One receipt shard: a pull of 2 reads exactly 2 (no read-ahead backlog), so each worker takes 4.
    _publish(redis_url, ids, receipt_shards=1)
    dataset = StagedRolloutDataset(
        redis_url,
        settings=ReaderSettings(receipt_shards=1),
        rollouts_per_batch=2,
        max_batches=2,
        block_ms=200,
        num_workers=2,
        consumer_prefix="w",
        multiprocessing_context="spawn",
        ack_wait_s=60.0,
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    consumers: set[str] = set()
    trained: list[str] = []
    for batch in loader:
        consumers.add(batch.consumer_name)
        assert batch.worker_id in (0, 1)
        dataset.ack(batch)
        trained += batch.ack_ids
    assert consumers == {"w-rank0-worker0", "w-rank0-worker1"}
    assert sorted(trained) == sorted(ids)  # each rollout to one worker, once
    # The workers applied every acknowledgement before they exited.
    assert _receipts_left(redis_url) == 0
    with redis.Redis.from_url(redis_url) as client:
        assert int(client.xpending(receipts_stream("stg", 0), "trainers")["pending"]) == 0


@pytest.mark.filterwarnings(MORE_WORKERS_THAN_CORES)
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_every_rollout_is_yielded_once_per_epoch_promptly_and_without_a_warning(
    redis_url: str, workers: int, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The stall found with 2 workers: rollouts one worker had read were yielded only after claim_idle_ms, each with a
    false "delivered 2 times" warning. Two epochs of exactly the rollouts published for them; claim_idle_ms is an
    hour, so a wait for a lease to expire would exceed the DataLoader's timeout (and the test's)."""
    caplog.set_level(logging.WARNING, logger="sink")
    readers, per_batch, batches = max(workers, 1), 4, 3
    dataset = StagedRolloutDataset(
        redis_url,
        settings=ReaderSettings(claim_idle_ms=AN_HOUR_MS),
        rollouts_per_batch=per_batch,
        max_batches=batches,
        num_workers=workers,
        block_ms=200,
        consumer_prefix="epoch",
    )
    for epoch in range(2):
        ids = [f"epoch{epoch}-{i}" for i in range(readers * per_batch * batches)]
        _publish(redis_url, ids)  # over every receipts shard
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            timeout=BATCH_TIMEOUT_S if workers else 0,
            worker_init_fn=_worker_warnings_to_stderr if workers else None,
        )
        yielded: list[str] = []
        for batch in loader:
            yielded += batch.ack_ids
            dataset.ack(batch)
        assert sorted(yielded) == sorted(ids)  # each rollout of the epoch, exactly once
    assert _receipts_left(redis_url) == 0 and _pending(redis_url) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert WORKER_WARNING not in capfd.readouterr().err


def test_an_acknowledgement_through_a_worker_is_applied_when_ack_returns(redis_url: str) -> None:
    """With workers, ``ack`` returns once the worker has acknowledged (as without workers), so breaking off the loop
    loses no acknowledgement; what the stopped workers had in hand goes to the next loader at once."""
    ids = [f"sync-{i}" for i in range(16)]
    _publish(redis_url, ids)
    settings = ReaderSettings(claim_idle_ms=AN_HOUR_MS)

    def dataset(prefix: str) -> StagedRolloutDataset:
        return StagedRolloutDataset(
            redis_url, settings=settings, rollouts_per_batch=2, num_workers=2, block_ms=200, consumer_prefix=prefix
        )

    first = dataset("first")
    trained: list[str] = []
    for batch in DataLoader(first, batch_size=None, num_workers=2, timeout=BATCH_TIMEOUT_S, in_order=False):
        left = _receipts_left(redis_url)
        first.ack(batch)
        assert _receipts_left(redis_url) == left - len(batch.ack_ids)  # acknowledged when ack() returned
        trained += batch.ack_ids
        if len(trained) >= 6:
            break  # the loader stops its workers
    second = dataset("second")  # other consumer names: nothing of the first loader's is its own pending
    rest: list[str] = []
    for batch in DataLoader(second, batch_size=None, num_workers=2, timeout=BATCH_TIMEOUT_S, in_order=False):
        second.ack(batch)
        rest += batch.ack_ids
        if len(trained) + len(rest) >= len(ids):
            break
    assert sorted(trained + rest) == sorted(ids)  # the acknowledged never again, the rest exactly once
    assert _receipts_left(redis_url) == 0 and _pending(redis_url) == 0


@pytest.mark.slow  # about 20 s: torch waits 5 s for each of the 4 workers before it terminates them
@pytest.mark.filterwarnings(MORE_WORKERS_THAN_CORES)
def test_a_stream_run_dry_yields_every_batch_and_a_broken_off_loop_gives_its_batches_in_flight_back(
    redis_url: str,
) -> None:
    """The docs' loader (``in_order=False``) over receipts that stop coming: every batch is yielded as soon as a
    worker has it, while other workers wait for receipts (in torch's default order a worker's batch waits for the
    next batch of the worker before it, which has none: 8 of 10 such runs stalled). Then the loop is broken off
    with every worker waiting inside the dataset: torch terminates them after its 5 s joins, and each still gives
    back the batches it yielded that were never acknowledged, so the next reader trains them at once, not after
    ``claim_idle_ms``."""
    ids = [f"dry-{i}" for i in range(12)]
    _publish(redis_url, ids)
    settings = ReaderSettings(claim_idle_ms=AN_HOUR_MS)
    first = StagedRolloutDataset(
        redis_url, settings=settings, rollouts_per_batch=2, num_workers=4, block_ms=200, consumer_prefix="first"
    )
    loop = iter(DataLoader(first, batch_size=None, num_workers=4, timeout=BATCH_TIMEOUT_S, in_order=False))
    batches = [next(loop)]
    while sum(len(batch.ack_ids) for batch in batches) < len(ids):
        batches.append(next(loop))
    # Every worker now waits inside the dataset for receipts that do not come (torch asks each for batches ahead).
    # Only the first batch is acknowledged: the rest are in flight.
    first.ack(batches[0])
    acknowledged = list(batches[0].ack_ids)
    in_flight = len(ids) - len(acknowledged)
    del loop  # the loop broken off: torch shuts its workers down

    async def the_rest() -> list[str]:
        async with RolloutReader.from_url(redis_url, settings.model_copy(update={"consumer_name": "next"})) as reader:
            pulled = [rollout.rollout_id for rollout in await pull_until(reader, in_flight, timeout_s=BATCH_TIMEOUT_S)]
            await reader.ack(pulled)
            return pulled

    again = anyio.run(the_rest)
    assert sorted(acknowledged + again) == sorted(ids)
    assert _receipts_left(redis_url) == 0 and _pending(redis_url) == 0


def test_a_worker_thread_reads_without_a_sigterm_handler_and_a_worker_process_gets_its_own_back() -> None:
    """Only a process's main thread may set a signal handler: a worker that is a thread leaves SIGTERM alone; a
    worker process's handler is the one it had again after its pass."""
    before = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            termination = _Termination()
            assert signal.getsignal(signal.SIGTERM) is before
            termination.restore()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(timeout=10)
    assert errors == [] and signal.getsignal(signal.SIGTERM) is before
    termination = _Termination()
    try:
        assert signal.getsignal(signal.SIGTERM) == termination._on_signal
    finally:
        termination.restore()
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_DFL if before is None else before)


def test_the_rank_comes_from_the_environment_without_torch_distributed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    assert StagedRolloutDataset(redis_url, consumer_prefix="r").consumer_name(1) == "r-rank3-worker1"
    assert StagedRolloutDataset(redis_url, rank=5).consumer_name(None) == "torch-rank5-workermain"
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(BatchInputError, match="RANK"):
        StagedRolloutDataset(redis_url)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "pack"}, "max_tokens"),
        ({"mode": "other"}, "mode"),
        ({"rollouts_per_batch": 0}, "rollouts_per_batch"),
        ({"num_workers": -1}, "num_workers"),
        ({"consumer_prefix": "bad name"}, "consumer_name"),
    ],
)
def test_bad_options_are_rejected_at_construction(fields: dict[str, object], message: str) -> None:
    with pytest.raises((BatchInputError, ValueError), match=message):
        StagedRolloutDataset("redis://127.0.0.1:1", **fields)  # type: ignore[arg-type]


def _run_example(url: str, tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """The torch example as a user runs it, against *url* (a subprocess, far below a 300 s lease wait)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "torch_training_loop.py"
    return subprocess.run(
        [sys.executable, "-W", "error", "-W", MORE_WORKERS_THAN_CORES, str(example), "--redis-url", url, *arguments],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        check=False,
    )


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_the_torch_example_trains_and_acknowledges_every_batch(redis_url: str, tmp_path: Path, workers: int) -> None:
    """As the docstring runs it (``--workers 2`` once gave 5 batches, then waited claim_idle_ms, 300 s, for the
    6th, with 4 false double-delivery warnings)."""
    result = _run_example(redis_url, tmp_path, "--steps", "3", "--workers", str(workers))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""  # no warning (the example leaves logging unconfigured: warnings go to stderr)
    lines = result.stdout.strip().splitlines()
    pattern = re.compile(r"step (\d+): rows=(\d+) tokens=(\d+) consumer=torch-rank0-worker(main|\d) loss=(-?[\d.]+)")
    matches = [pattern.fullmatch(line) for line in lines]
    readers = max(workers, 1)
    assert len(lines) == 3 * readers and all(matches), lines
    assert sum(int(m.group(2)) for m in matches if m) == 12 * readers
    names = {m.group(4) for m in matches if m}
    assert names == ({"main"} if workers == 0 else {str(w) for w in range(workers)})
    assert _receipts_left(redis_url) == 0


async def _publish_with_a_poisoned_rollout(url: str, ids: list[str], poisoned: str) -> None:
    """Stage *ids*, poison *poisoned* (a capture failure in its ledger), finish all and publish their receipts."""
    await stage_rollouts(url, ids, calls=2)
    async with RedisCaptureLedger.from_url(url) as ledger:
        await ledger.record_failure(poisoned, "c9", "worker_capture_failed")
    await publish_staged(url, ids)


def test_the_torch_example_says_which_rollouts_it_sets_aside(redis_url: str, tmp_path: Path) -> None:
    ids = ["good-0", "good-1", "good-2", "poisoned"]
    anyio.run(_publish_with_a_poisoned_rollout, redis_url, ids, "poisoned")
    result = _run_example(redis_url, tmp_path, "--no-simulate", "--steps", "1", "--rollouts-per-step", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 0: rows=3 "), lines
    assert lines[1] == "set aside rollout 'poisoned': rollout_failed (worker_capture_failed)"
    assert _receipts_left(redis_url) == 0  # acknowledged with its batch
