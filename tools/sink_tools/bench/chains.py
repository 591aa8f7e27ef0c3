"""Benchmark: pull + verify + linearize per token for rollouts of 1, 2 and 8 chains (contract §14).

``staging-sink bench trainer --chains 1,2,8``: every rollout holds the same calls and tokens, split into that many
chains (trees of ``calls / chains`` calls, the policy ``roots`` recorded for more than one), so the figures compare
the per-token cost of the trainer reader's pull path (read, claim, one fetch per rollout, decode with digest check,
verification of each chain, ``as_numpy()`` of every row) side by side in one run, best of ``--repeats``. Target:
8 chains within 1.2x of one chain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anyio
import redis.asyncio as aioredis

from sink.contract.chains import ChainPolicy
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, hash_token_ids
from sink.contract.records import CallRecord, CaptureLedgerCommit, StagedCallRecord
from sink.errors import StagingError
from sink.keys import claim_key, receipts_stream
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import DEFAULT_SHARDS
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import TRAINER_GROUP, RolloutReader
from sink_tools.bench import bench_namespace, on_server
from sink_tools.bench.workload import assemble_receipts

__all__ = ("build_chain_records", "chain_main", "format_chain_report", "run_chain_benchmark")


def build_chain_records(
    rollout_id: str, chains: int, calls_per_chain: int, tokens: int, seed: int
) -> list[list[StagedCallRecord]]:
    """*chains* linear trees of *calls_per_chain* calls each for one rollout (float32-exact log-probs)."""
    trees: list[list[StagedCallRecord]] = []
    for chain in range(chains):
        tree: list[StagedCallRecord] = []
        sequence: list[int] = []
        for call in range(calls_per_chain):
            parent = tree[-1] if tree else None
            carry = 16 if parent is not None else 64
            ids = [(seed * 7919 + chain * 613 + call * 104729 + i * 31) % 150_000 for i in range(tokens)]
            record = StagedCallRecord.from_components(
                rollout_id=rollout_id,
                model_call_id=f"t{chain}c{call}",
                parent_call_id=None if parent is None else parent.model_call_id,
                mode="text" if parent is None else "token_in",
                prev_len=len(sequence),
                delta_len=tokens,
                cum_len=len(sequence) + tokens,
                weight_version=1,
                token_ids_delta=ids,
                token_mask_delta=[0.0] * carry + [1.0] * (tokens - carry),
                generation_log_probs_delta=[0.0] * carry + [-((i % 97) + 1) / 64.0 for i in range(tokens - carry)],
                extras=None,
                extras_digest=EMPTY_EXTRAS_DIGEST,
                chain_hash=compute_chain_hash(None if parent is None else parent.chain_hash, ids),
                cumulative_hash=hash_token_ids(sequence + ids),
            )
            sequence += ids
            tree.append(record)
        trees.append(tree)
    return trees


async def _stage(url: str, ns: str, rollouts: dict[str, list[list[StagedCallRecord]]], chains: int) -> None:
    async with (
        AsyncRedisStagingSink.from_url(url, namespace=ns) as sink,
        RedisCaptureLedger.from_url(url, namespace=ns) as ledger,
    ):
        for rollout_id, trees in rollouts.items():
            if chains > 1:
                await ledger.record_chain_policy(rollout_id, ChainPolicy.ROOTS)
            admitted = 0.0
            for tree in trees:
                for index, record in enumerate(tree):
                    result = await sink.stage(record)
                    if not result.ok:
                        raise RuntimeError(f"stage failed: {result.error}")
                    admitted += 1.0
                    row = CallRecord(
                        **record.model_dump(include=set(CallRecord.model_fields) - {"schema_version"}),
                        staging_key=record.staging_key,
                        response_id=f"resp-{record.model_call_id}",
                        admitted_at=admitted,
                    )
                    staging_chain = tuple(r.staging_key for r in tree[: index + 1])
                    commit = CaptureLedgerCommit(
                        rollout_id=rollout_id,
                        record=row,
                        staging_chain=staging_chain,
                        request_items=[],
                        response_items=[],
                    )
                    await ledger.record(commit)
    await assemble_receipts(url, ns, list(rollouts))


async def _pull_loop(url: str, ns: str, rollouts: int, chains: int) -> tuple[float, int]:
    """Seconds and linearized tokens of one trainer loop over every rollout; leaves them pending for the next."""
    tokens = 0
    pulled_ids: list[str] = []
    async with RolloutReader.from_url(url, namespace=ns, consumer_name=f"bench-{time.monotonic_ns()}") as reader:
        start = time.perf_counter()
        while len(pulled_ids) < rollouts:
            for item in await reader.pull(8, block_ms=1_000):
                if len(item.rows) != chains:
                    raise RuntimeError(f"rollout {item.rollout_id}: {len(item.rows)} rows, {item.skip_code}")
                arrays = [row.as_numpy() for row in item.rows]
                tokens += sum(len(columns.token_ids) for columns in arrays)
                pulled_ids.append(item.rollout_id)
        seconds = time.perf_counter() - start
    async with aioredis.Redis.from_url(url) as admin:
        for shard in range(DEFAULT_SHARDS):
            await admin.xgroup_destroy(receipts_stream(ns, shard), TRAINER_GROUP)
        await admin.delete(*(claim_key(ns, rollout_id) for rollout_id in pulled_ids))
    return seconds, tokens


async def run_chain_benchmark(
    url: str,
    *,
    chain_counts: tuple[int, ...] = (1, 2, 8),
    rollouts: int = 16,
    calls: int = 32,
    tokens: int = 2048,
    repeats: int = 3,
    namespace: str,
) -> dict[int, float]:
    """ns per linearized token of the pull path for each chain count (best of *repeats*), one namespace each.

    :raises ValueError: a chain count does not divide *calls*.
    """
    if any(count < 1 or calls % count for count in chain_counts):
        raise ValueError(f"every chain count must divide calls={calls}")
    figures: dict[int, float] = {}
    for count in chain_counts:
        async with bench_namespace(url, f"{namespace}-c{count}") as space:  # its keys are deleted on exit
            staged = {
                f"chains{count}-{r}": build_chain_records(f"chains{count}-{r}", count, calls // count, tokens, r)
                for r in range(rollouts)
            }
            await _stage(url, space.namespace, staged, count)
            best = float("inf")
            for _ in range(repeats):
                seconds, linearized = await _pull_loop(url, space.namespace, rollouts, count)
                best = min(best, seconds * 1e9 / linearized)
            figures[count] = best
    return figures


def format_chain_report(figures: dict[int, float]) -> str:
    """One line per chain count: ns per token and the ratio to one chain."""
    base = figures.get(1)
    lines = ["pull + verify + linearize, ns per linearized token (same total tokens per rollout):"]
    for count, value in figures.items():
        ratio = f"  {value / base:.2f}x of 1 chain" if base else ""
        lines.append(f"  {count} chain(s): {value:8.2f} ns/token{ratio}")
    return "\n".join(lines)


def chain_main(args: argparse.Namespace) -> int:
    """``staging-sink bench trainer --chains 1,2,8``: the parsed options of :mod:`sink_tools.bench.trainer`."""
    counts = tuple(int(part) for part in args.chains.split(","))

    def run(url: str) -> dict[int, float]:
        return anyio.run(
            lambda: run_chain_benchmark(
                url,
                chain_counts=counts,
                rollouts=args.rollouts,
                calls=args.calls,
                tokens=args.tokens,
                repeats=args.repeats,
                namespace=args.namespace,
            )
        )

    try:
        figures = on_server(args.redis_url, lambda url, _server: run(url))
    except (StagingError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stdout.write((json.dumps(figures, indent=2) if args.json else format_chain_report(figures)) + "\n")
    return 0
