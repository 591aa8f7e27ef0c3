"""The synthetic records the staging and trainer benchmarks write: linear chains of child calls."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import redis.asyncio as aioredis

from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, hash_token_ids
from sink.contract.records import StagedCallRecord
from sink.rollout.assembler import Assembler, finished
from sink.store.streams import StreamEntry

__all__ = ("assemble_receipts", "build_records")


def build_records(rollouts: int, calls: int, tokens: int, *, tag: str) -> list[StagedCallRecord]:
    """Linear chains of child calls with float32-exact log-probs, ids < 2**32."""
    records = []
    for r in range(rollouts):
        sequence: list[int] = []
        parent: StagedCallRecord | None = None
        for c in range(calls):
            carry = 16 if parent is not None else 64
            ids = [(r * 7919 + c * 104729 + i * 31) % 150_000 for i in range(tokens)]
            mask = [0.0] * carry + [1.0] * (tokens - carry)
            logprobs = [0.0] * carry + [-((i % 97) + 1) / 64.0 for i in range(tokens - carry)]
            record = StagedCallRecord.from_components(
                rollout_id=f"{tag}-{r}",
                model_call_id=f"c{c}",
                parent_call_id=None if parent is None else parent.model_call_id,
                mode="text" if parent is None else "token_in",
                prev_len=len(sequence),
                delta_len=tokens,
                cum_len=len(sequence) + tokens,
                weight_version=1,
                token_ids_delta=ids,
                token_mask_delta=mask,
                generation_log_probs_delta=logprobs,
                extras=None,
                extras_digest=EMPTY_EXTRAS_DIGEST,
                chain_hash=compute_chain_hash(None if parent is None else parent.chain_hash, ids),
                cumulative_hash=hash_token_ids(sequence + ids),
            )
            sequence += ids
            records.append(record)
            parent = record
    return records


async def assemble_receipts(url: str, ns: str, rollout_ids: Sequence[str], *, group_size: int | None = None) -> None:
    """Finish every rollout of *rollout_ids* (reward 1.0) and run an assembler until each receipt is published.

    *group_size*: finish them as GRPO groups, each run of *group_size* consecutive rollouts one group (its id: the
    first member's id + ``-group``; the last group may be smaller than announced)."""
    published = anyio.Event()
    seen: list[StreamEntry] = []

    async def count(entry: StreamEntry) -> None:
        seen.append(entry)
        if len(seen) == len(rollout_ids):
            published.set()

    async with aioredis.Redis.from_url(url) as client:
        for index, rollout_id in enumerate(rollout_ids):
            if group_size is None:
                await finished(client, rollout_id, reward=1.0, namespace=ns)
            else:
                group_id = f"{rollout_ids[index - index % group_size]}-group"
                await finished(client, rollout_id, reward=1.0, namespace=ns, group_id=group_id, group_size=group_size)
    async with (
        Assembler.from_url(url, before_ack=count, block_ms=100, namespace=ns) as assembler,
        anyio.create_task_group() as group,
    ):
        group.start_soon(assembler.run)
        with anyio.fail_after(120):
            await published.wait()
        assembler.stop()
