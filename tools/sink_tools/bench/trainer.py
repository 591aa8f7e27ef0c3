"""Benchmark: the trainer's pull + verify + linearize path against the fetch-and-hash floor.

Run ``python -m sink_tools.bench.trainer [--redis-url URL]`` (default: a private
durable server). Stages 64 rollouts x 32 calls x 2,048 tokens (linear chains)
through the sink, records their ledgers, assembles receipts, then measures in
one run, in ns per linearized token:

* ``pull``: a trainer loop, best of ``--repeats``: :meth:`RolloutReader.pull`
  8 rollouts at a time (read, claim, one fetch per rollout, decode with digest
  check, ``verify_and_linearize``) plus ``as_numpy()`` of every row, one
  batch's arrays alive at a time (``--keep-all``: every batch's);
* ``collate`` / ``pack``: the same loop, each pull turned into one padded
  :class:`~sink.trainer.batch.TrainingBatch` (:func:`~sink.trainer.batch.collate`) or into
  bins of twice the row length (:func:`~sink.trainer.packing.pack`) instead of
  per-row arrays; the targets: collation adds <= 20% to the pull path,
  packing <= 40%, the packed trainer loop stays <= 3x the floor;
* the same work split up, best of ``--repeats``: fetch+decode, verify+linearize,
  then the columns either as numpy arrays or as plain Python lists;
* the floor: a raw ``MGET`` of the same bytes (one per rollout, as the reader
  does) plus ``hashlib.sha256`` over exactly the bytes the contract hashes:
  per call the call-digest payload (~16 bytes/token plus a fixed header) and
  the chain-hash input (8 bytes/token), plus the terminal's cumulative-hash
  input (8 bytes/token over the whole row).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import anyio
import redis.asyncio as aioredis

from sink.contract.records import CallRecord, CaptureLedgerCommit, RolloutReceipt, StagedCallRecord
from sink.keys import claim_key, receipts_stream, record_key
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import DEFAULT_SHARDS
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.batch import collate
from sink.trainer.packing import pack
from sink.trainer.reader.rollout_reader import TRAINER_GROUP, RolloutReader
from sink.trainer.verify import LinearizedRow, verify_decoded_and_linearize
from sink_tools.bench import DEFAULT_BENCH_NAMESPACE, BenchHelpFormatter, bench_namespace, report_on_server
from sink_tools.bench.chains import chain_main
from sink_tools.bench.workload import assemble_receipts, build_records

__all__ = ("TrainerFigures", "format_report", "main", "run_trainer_benchmark", "stage_and_assemble")


@dataclass(frozen=True, slots=True)
class TrainerFigures:
    """ns per linearized token for each measured path (``tokens`` = total linearized tokens)."""

    rollouts: int
    keep_all: bool
    calls: int
    tokens_per_call: int
    tokens: int
    pull_numpy_ns: float
    pull_collate_ns: float
    pull_pack_ns: float
    fetch_decode_ns: float
    verify_linearize_ns: float
    to_numpy_ns: float
    to_lists_ns: float
    path_numpy_ns: float
    path_lists_ns: float
    floor_ns: float
    floor_mget_ns: float
    floor_sha256_ns: float


def _digest_payload_bytes(record: StagedCallRecord) -> int:
    """Size of the call-digest payload (contract §4.3): framed scalars plus ids (8 B) and two columns (4 B each)."""
    texts = sum(8 + len(s.encode()) for s in (record.rollout_id, record.model_call_id, record.mode))
    columns = 16 + 8 * record.delta_len + 2 * (16 + 4 * record.delta_len)
    return 3 + texts + 9 + len(record.parent_call_id or "") + 32 + columns + 32 + 33 + 33


async def stage_and_assemble(
    url: str, ns: str, records: list[StagedCallRecord], calls: int, *, group_size: int | None = None
) -> None:
    """Stage *records* (rollouts of *calls* calls each), record their ledgers, finish them and assemble receipts
    (*group_size*: as GRPO groups, see :func:`~sink_tools.bench.workload.assemble_receipts`)."""
    await stage_records(url, ns, records, calls)
    rollout_ids = list(dict.fromkeys(record.rollout_id for record in records))
    await assemble_receipts(url, ns, rollout_ids, group_size=group_size)


async def stage_records(url: str, ns: str, records: list[StagedCallRecord], calls: int) -> None:
    """Stage *records* (rollouts of *calls* calls each) and record their ledgers, as the workers do."""
    limiter = anyio.CapacityLimiter(64)
    async with (
        AsyncRedisStagingSink.from_url(url, namespace=ns) as sink,
        RedisCaptureLedger.from_url(url, namespace=ns) as ledger,
        anyio.create_task_group() as group,
    ):

        async def stage_rollout(chain: list[StagedCallRecord]) -> None:
            async with limiter:
                for index, record in enumerate(chain):
                    result = await sink.stage(record)
                    if not result.ok:
                        raise RuntimeError(f"stage failed: {result.error}")
                    row = CallRecord(
                        **record.model_dump(include=set(CallRecord.model_fields) - {"schema_version"}),
                        staging_key=record.staging_key,
                        response_id=f"resp-{index}",
                        admitted_at=float(index),
                    )
                    staging_chain = tuple(r.staging_key for r in chain[: index + 1])
                    await ledger.record(
                        CaptureLedgerCommit(
                            rollout_id=record.rollout_id,
                            record=row,
                            staging_chain=staging_chain,
                            request_items=[],
                            response_items=[],
                        )
                    )

        for start in range(0, len(records), calls):
            group.start_soon(stage_rollout, records[start : start + calls])


def _columns_as_lists(row: LinearizedRow) -> tuple[list[int], list[float], list[float]]:
    """The same columns as plain Python lists, built from the same packed bytes as ``as_numpy``."""
    parts = row.columns.packed_parts
    if parts is None:
        return list(row.token_ids), list(row.token_mask), list(row.logprobs)
    ids: list[int] = []
    masks: list[float] = []
    logprobs: list[float] = []
    for part in parts:
        ids += part.token_ids_list()
        masks += part.token_mask_list()
        logprobs += part.log_probs_list()
    return ids, masks, logprobs


async def _split_path(url: str, ns: str, receipts: list[RolloutReceipt]) -> dict[str, float]:
    """Seconds for fetch+decode, verify+linearize, numpy columns and list columns over every receipt."""
    totals = dict.fromkeys(("fetch", "verify", "numpy", "lists"), 0.0)
    async with AsyncRedisStagingSource.from_url(url, namespace=ns) as source:
        for receipt in receipts:
            start = time.perf_counter()
            snapshots = await source.fetch_packed([row.staging_key for row in receipt.manifest])
            fetched = time.perf_counter()
            row = verify_decoded_and_linearize(receipt, snapshots)
            verified = time.perf_counter()
            row.as_numpy()
            numpy_done = time.perf_counter()
            _columns_as_lists(row)
            lists_done = time.perf_counter()
            totals["fetch"] += fetched - start
            totals["verify"] += verified - fetched
            totals["numpy"] += numpy_done - verified
            totals["lists"] += lists_done - numpy_done
    return totals


async def _floor(
    url: str, ns: str, receipts: list[RolloutReceipt], records: dict[str, StagedCallRecord]
) -> tuple[float, float]:
    """Seconds for the raw MGETs and for sha256 over the contract's hashed bytes."""
    mget_s = sha_s = 0.0
    async with aioredis.Redis.from_url(url) as client:
        for receipt in receipts:
            keys = [record_key(ns, row.staging_key) for row in receipt.manifest]
            chain = [records[row.staging_key] for row in receipt.manifest]
            payloads = [bytes(_digest_payload_bytes(r)) for r in chain] + [bytes(16 + 8 * r.delta_len) for r in chain]
            payloads.append(bytes(16 + 8 * chain[-1].cum_len))
            start = time.perf_counter()
            await client.mget(keys)
            fetched = time.perf_counter()
            for payload in payloads:
                hashlib.sha256(payload).digest()
            mget_s += fetched - start
            sha_s += time.perf_counter() - fetched
    return mget_s, sha_s


_PULL_BATCH = 8


async def _trainer_loop(url: str, ns: str, rollouts: int, *, keep_all: bool, last: bool, mode: str = "numpy") -> float:
    """Seconds for a trainer loop over every rollout: pull a batch and turn it into numpy columns (*mode*
    ``numpy``), one collated batch (``collate``) or packed bins (``pack``), which live until the next batch
    replaces them (*keep_all*: every batch's stay alive to the end).

    The *last* loop acknowledges what it pulled; the others leave the rollouts pending and reset the
    trainers group and the claims, so the next loop is delivered the same receipts afresh.
    """
    async with RolloutReader.from_url(url, namespace=ns, consumer_name=f"bench-{time.monotonic_ns()}") as reader:
        start = time.perf_counter()
        kept: list[object] = []
        pulled_ids: list[str] = []
        while len(pulled_ids) < rollouts:
            pulled = await reader.pull(_PULL_BATCH, block_ms=1_000)
            for item in pulled:
                if item.row is None:
                    raise RuntimeError(f"rollout {item.rollout_id} was not trainable: {item.skip_code}")
                pulled_ids.append(item.rollout_id)
            batch: object
            if mode == "collate":
                batch = collate(pulled)
            elif mode == "pack":
                longest = max((len(item.row.columns) for item in pulled if item.row is not None), default=1)
                batch = pack(pulled, max_tokens=2 * longest)
            else:
                batch = [item.row.as_numpy() for item in pulled if item.row is not None]
            kept = [*kept, batch] if keep_all else [batch]
        seconds = time.perf_counter() - start
        del kept
        if last:
            await reader.ack(pulled_ids)
    if not last:
        async with aioredis.Redis.from_url(url) as admin:
            for shard in range(DEFAULT_SHARDS):
                await admin.xgroup_destroy(receipts_stream(ns, shard), TRAINER_GROUP)
            await admin.delete(*(claim_key(ns, rollout_id) for rollout_id in pulled_ids))
    return seconds


async def _published_receipts(url: str, ns: str, rollouts: int) -> list[RolloutReceipt]:
    """The stored receipts of the staged rollouts (read without consuming the receipts streams)."""
    async with aioredis.Redis.from_url(url) as client:
        keys = [key async for key in client.scan_iter(match=f"{ns}:{{*}}:receipt", count=1000)]
        texts = await client.mget(keys)
    receipts = [RolloutReceipt.model_validate_json(text) for text in texts if text is not None]
    if len(receipts) != rollouts:
        raise RuntimeError(f"expected {rollouts} receipts, found {len(receipts)}")
    return sorted(receipts, key=lambda receipt: receipt.rollout_id)


async def run_trainer_benchmark(
    url: str,
    *,
    rollouts: int = 64,
    calls: int = 32,
    tokens: int = 2048,
    repeats: int = 3,
    keep_all: bool = False,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
) -> TrainerFigures:
    """Stage, assemble and measure on *url*, in *namespace* only (its keys deleted at the end; refused when it
    already has keys).

    With *keep_all*, the trainer loop keeps every batch's numpy columns alive until it ends (16 bytes per
    token of memory that must be fresh), instead of one batch at a time.
    """
    async with bench_namespace(url, namespace):
        records = build_records(rollouts, calls, tokens, tag="trainer")
        by_key = {record.staging_key: record for record in records}
        await stage_and_assemble(url, namespace, records, calls)
        total_tokens = rollouts * calls * tokens

        receipts = await _published_receipts(url, namespace, rollouts)
        # Warm runs of the split path first, so the pull below is not the process's first decode.
        split = [await _split_path(url, namespace, receipts) for _ in range(repeats)]
        floors = [await _floor(url, namespace, receipts, by_key) for _ in range(repeats)]
        loops: dict[str, list[float]] = {"numpy": [], "collate": [], "pack": []}
        for run in range(repeats):
            # Interleaved, so a slow phase of a shared machine hits every mode alike.
            for mode, seconds in loops.items():
                last = run == repeats - 1 and mode == "pack"
                seconds.append(await _trainer_loop(url, namespace, rollouts, keep_all=keep_all, last=last, mode=mode))
        pull_s = min(loops["numpy"])

    def ns(seconds: float) -> float:
        return seconds * 1e9 / total_tokens

    best = {name: min(run[name] for run in split) for name in split[0]}
    mget_s, sha_s = min(floors, key=sum)
    return TrainerFigures(
        rollouts=rollouts,
        keep_all=keep_all,
        calls=calls,
        tokens_per_call=tokens,
        tokens=total_tokens,
        pull_numpy_ns=ns(pull_s),
        pull_collate_ns=ns(min(loops["collate"])),
        pull_pack_ns=ns(min(loops["pack"])),
        fetch_decode_ns=ns(best["fetch"]),
        verify_linearize_ns=ns(best["verify"]),
        to_numpy_ns=ns(best["numpy"]),
        to_lists_ns=ns(best["lists"]),
        path_numpy_ns=ns(best["fetch"] + best["verify"] + best["numpy"]),
        path_lists_ns=ns(best["fetch"] + best["verify"] + best["lists"]),
        floor_ns=ns(mget_s + sha_s),
        floor_mget_ns=ns(mget_s),
        floor_sha256_ns=ns(sha_s),
    )


def format_report(f: TrainerFigures) -> str:
    """Human-readable summary with the path/floor ratio."""
    return "\n".join(
        [
            f"{f.rollouts} rollouts x {f.calls} calls x {f.tokens_per_call} tokens = {f.tokens:,} tokens (ns/token)",
            (
                f"  trainer loop: pull 8 at a time (claim+fetch+decode+verify+linearize) + as_numpy "
                f"({'every batch kept' if f.keep_all else 'one batch alive at a time'}): {f.pull_numpy_ns:7.1f}"
            ),
            (
                f"  trainer loop + collate (one padded batch per pull): {f.pull_collate_ns:7.1f}"
                f"  ({100 * (f.pull_collate_ns / f.pull_numpy_ns - 1):+.0f}% over as_numpy; target <= +20%)"
            ),
            (
                f"  trainer loop + pack (first-fit decreasing bins): {f.pull_pack_ns:7.1f}"
                f"  ({100 * (f.pull_pack_ns / f.pull_numpy_ns - 1):+.0f}% over as_numpy; target <= +40%)"
            ),
            (
                f"  split: fetch+decode {f.fetch_decode_ns:.1f}, verify+linearize {f.verify_linearize_ns:.1f}, "
                f"as_numpy {f.to_numpy_ns:.1f}, plain lists {f.to_lists_ns:.1f}"
            ),
            f"  path ending in numpy  : {f.path_numpy_ns:7.1f}",
            f"  path ending in lists  : {f.path_lists_ns:7.1f}",
            f"  floor (MGET {f.floor_mget_ns:.1f} + sha256 {f.floor_sha256_ns:.1f}): {f.floor_ns:7.1f}",
            f"  numpy path / floor    : {f.path_numpy_ns / f.floor_ns:7.2f}x",
            f"  trainer loop / floor  : {f.pull_numpy_ns / f.floor_ns:7.2f}x",
            f"  packed loop / floor   : {f.pull_pack_ns / f.floor_ns:7.2f}x (target <= 3x)",
            f"  numpy vs plain lists  : {f.to_lists_ns / f.to_numpy_ns:7.2f}x faster",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.trainer [--redis-url URL] [--json]``."""
    parser = argparse.ArgumentParser(
        prog="staging-sink bench trainer",
        description=__doc__.splitlines()[0],
        formatter_class=BenchHelpFormatter,
    )
    parser.add_argument(
        "--redis-url",
        help="use this durable server instead of a private one; only keys under --namespace are written and "
        "deleted, and a namespace that already has keys is refused (default: start a private server)",
    )
    parser.add_argument("--namespace", default=DEFAULT_BENCH_NAMESPACE, help="key namespace")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts staged")
    parser.add_argument("--calls", type=int, default=32, help="calls per rollout")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per call")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (best kept)")
    parser.add_argument(
        "--keep-all", action="store_true", help="keep every batch's numpy columns alive in the trainer loop"
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    parser.add_argument("--chains", help="instead: compare rollouts of these chain counts, e.g. 1,2,8 (§14)")
    args = parser.parse_args(argv)
    if args.chains:
        return chain_main(args)

    def run(url: str) -> TrainerFigures:
        return anyio.run(
            lambda: run_trainer_benchmark(
                url,
                rollouts=args.rollouts,
                calls=args.calls,
                tokens=args.tokens,
                repeats=args.repeats,
                keep_all=args.keep_all,
                namespace=args.namespace,
            )
        )

    return report_on_server(
        args.redis_url, lambda url, _server: run(url), format_report, as_json=args.json, to_json=asdict
    )


if __name__ == "__main__":
    raise SystemExit(main())
