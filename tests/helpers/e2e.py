"""End-to-end helpers: stage whole rollouts through the real sink and ledger, run assemblers, pull rows.

Shared by ``test_assembler.py`` and ``test_trainer.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from sink.contract.records import CallRecord, CaptureLedgerCommit, StagedCallRecord
from sink.keys import DEFAULT_NAMESPACE
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler
from sink.store.sink import AsyncRedisStagingSink
from sink.store.streams import StreamEntry
from sink.trainer.reader.rollout_reader import PulledRollout, RolloutReader
from tests.helpers.staging import make_chain

__all__ = (
    "EventCounter",
    "StagedRollout",
    "call_record_of",
    "pull_until",
    "running_assembler",
    "stage_rollout",
    "stage_rollouts",
)


@dataclass(frozen=True)
class StagedRollout:
    """A linear chain staged through the sink, with its ledger rows recorded."""

    rollout_id: str
    records: tuple[StagedCallRecord, ...]

    @property
    def staging_keys(self) -> list[str]:
        return [record.staging_key for record in self.records]

    @property
    def token_ids(self) -> list[int]:
        return [token for record in self.records for token in record.token_ids_delta]

    @property
    def token_mask(self) -> list[float]:
        return [mask for record in self.records for mask in record.token_mask_delta]

    @property
    def logprobs(self) -> list[float]:
        return [lp for record in self.records for lp in record.generation_log_probs_delta]

    @property
    def call_ids(self) -> tuple[str, ...]:
        return tuple(record.model_call_id for record in self.records)


def call_record_of(record: StagedCallRecord, *, admitted_at: float) -> CallRecord:
    """The ledger row a gate would commit for a staged record (fingerprints left ``None``)."""
    return CallRecord(
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        staging_key=record.staging_key,
        mode=record.mode,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
        response_id=f"resp-{record.rollout_id}-{record.model_call_id}",
        admitted_at=admitted_at,
    )


async def stage_rollout(
    sink: AsyncRedisStagingSink,
    ledger: RedisCaptureLedger,
    rollout_id: str,
    *,
    calls: int = 3,
    n_tokens: int = 8,
    extras: Sequence[dict[str, Any] | None] | None = None,
    chain: Sequence[StagedCallRecord] | None = None,
) -> StagedRollout:
    """Stage a linear chain of *calls* records (*extras*: one per call), or the records of *chain*, durably and
    record one custody row per call."""
    chain = list(chain) if chain is not None else make_chain(rollout_id, calls, n_tokens=n_tokens, extras=extras)
    staging_chain: list[str] = []
    for index, record in enumerate(chain):
        result = await sink.stage(record)
        assert result.ok, result.error
        staging_chain.append(record.staging_key)
        commit = CaptureLedgerCommit(
            rollout_id=rollout_id,
            record=call_record_of(record, admitted_at=1000.0 + index),
            staging_chain=tuple(staging_chain),
            request_items=[],
            response_items=[],
        )
        await ledger.record(commit)
    return StagedRollout(rollout_id, tuple(chain))


async def stage_rollouts(url: str, rollout_ids: Sequence[str], **kwargs: Any) -> list[StagedRollout]:
    """Open a sink and a ledger on *url* (plain or cluster via ``cluster=``, in ``namespace=``) and stage every
    rollout."""
    cluster = bool(kwargs.pop("cluster", False))
    namespace = str(kwargs.pop("namespace", DEFAULT_NAMESPACE))
    async with (
        AsyncRedisStagingSink.from_url(url, cluster=cluster, namespace=namespace) as sink,
        RedisCaptureLedger.from_url(url, cluster=cluster, namespace=namespace) as ledger,
    ):
        return [await stage_rollout(sink, ledger, rollout_id, **kwargs) for rollout_id in rollout_ids]


class EventCounter:
    """A ``before_ack`` hook that counts events and sets :attr:`reached` once *target* were seen."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.entries: list[StreamEntry] = []
        self.reached = anyio.Event()

    async def __call__(self, entry: StreamEntry) -> None:
        self.entries.append(entry)
        if len(self.entries) >= self.target:
            self.reached.set()


@asynccontextmanager
async def running_assembler(url: str, **fields: Any) -> AsyncIterator[Assembler]:
    """An :class:`Assembler` running in a task group for the block; stopped gracefully on exit."""
    before_ack = fields.pop("before_ack", None)
    async with (
        Assembler.from_url(url, before_ack=before_ack, **fields) as assembler,
        anyio.create_task_group() as group,
    ):
        group.start_soon(assembler.run)
        try:
            yield assembler
        finally:
            assembler.stop()


async def pull_until(
    reader: RolloutReader, count: int, *, timeout_s: float = 20.0, batch: int = 16, block_ms: int = 100
) -> list[PulledRollout]:
    """Pull until *count* rollouts came back (fails the test on timeout)."""
    pulled: list[PulledRollout] = []
    with anyio.fail_after(timeout_s):
        while len(pulled) < count:
            pulled += await reader.pull(min(batch, count - len(pulled)), block_ms=block_ms)
    return pulled
