"""NeMo Gym's external-staging path with staging-sink's synchronous StagingSink / StagingSource.

A framework inference worker (NeMo RL's vLLM worker is the reference) stages each model call's token delta
from many threads at once and records, token-free, which key holds which call (Gym's custody ledger); a
finalizer later fetches every rollout's records by key, checks them against the ledger, and clears them.
Here the worker's in-memory queue is replaced by a durable Redis/Valkey server: ``stage`` returns
``ok=True`` only once the record is fsynced.

    .venv/bin/python examples/gym_external_staging.py                   # a private durable server
    .venv/bin/python examples/gym_external_staging.py --redis-url URL   # your server (writes under --namespace)
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from sink import StagedCallRecord
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, hash_token_ids
from sink.contract.protocols import StagingSink, StagingSource
from sink.server import DurableServer
from sink.store import RedisStagingSink, RedisStagingSource

LedgerRow = tuple[str, str, str]  # (model_call_id, staging_key, digest): what Gym's custody ledger keeps


def generate(rollout_id: str, call: int, parent: StagedCallRecord | None, sequence: list[int]) -> StagedCallRecord:
    """One model call's record, as the worker builds it after the engine returns (a stand-in engine here)."""
    prompt = [1000 + call, 1001 + call] if parent is None else [2000 + call]  # the new prompt tokens of this turn
    generated = [(hash((rollout_id, call, i)) % 150_000) for i in range(8)]
    delta = prompt + generated
    return StagedCallRecord.from_components(
        rollout_id=rollout_id,
        model_call_id=f"call-{call}",
        parent_call_id=None if parent is None else parent.model_call_id,
        mode="text" if parent is None else "token_in",
        prev_len=len(sequence),
        delta_len=len(delta),
        cum_len=len(sequence) + len(delta),
        weight_version=1,
        token_ids_delta=delta,
        token_mask_delta=[0.0] * len(prompt) + [1.0] * len(generated),
        generation_log_probs_delta=[0.0] * len(prompt) + [-0.25] * len(generated),
        extras=None,
        extras_digest=EMPTY_EXTRAS_DIGEST,
        chain_hash=compute_chain_hash(None if parent is None else parent.chain_hash, delta),
        cumulative_hash=hash_token_ids(sequence + delta),
    )


def worker_rollout(sink: StagingSink, rollout_id: str, calls: int) -> list[LedgerRow]:
    """One rollout's calls, in order, as a worker thread serves them: stage before the response returns."""
    ledger: list[LedgerRow] = []
    parent: StagedCallRecord | None = None
    sequence: list[int] = []
    for call in range(calls):
        record = generate(rollout_id, call, parent, sequence)
        result = sink.stage(record)  # thread-safe, synchronous; durable when ok
        if not result.ok or result.staging_key is None:
            raise RuntimeError(f"stage of {rollout_id}/{record.model_call_id} failed: {result.error}")
        ledger.append((record.model_call_id, result.staging_key, record.digest))
        sequence += record.token_ids_delta
        parent = record
    return ledger


def finalize(source: StagingSource, rollout_id: str, ledger: Sequence[LedgerRow]) -> int:
    """Fetch one rollout's records by the ledger's keys and check them against it: digests and chain links.

    :returns: the rollout's token count.
    """
    snapshots = source.fetch([key for _, key, _ in ledger])  # KeyError if any key is missing
    parent_hash: str | None = None
    for (call_id, _key, digest), snapshot in zip(ledger, snapshots, strict=True):
        if snapshot.model_call_id != call_id or snapshot.digest != digest:
            raise RuntimeError(f"{rollout_id}/{call_id}: the staged record does not match the ledger")
        if snapshot.chain_hash != compute_chain_hash(parent_hash, snapshot.token_ids_delta):
            raise RuntimeError(f"{rollout_id}/{call_id}: broken chain link")
        parent_hash = snapshot.chain_hash
    return snapshots[-1].cum_len


def run(url: str, *, namespace: str, rollouts: int, calls: int, threads: int) -> tuple[int, int, int]:
    """Stage *rollouts* x *calls* from *threads* worker threads, finalize every rollout, clear it.

    :returns: (rollouts finalized, records fetched, distinct worker threads that staged).
    """
    seen_threads: set[int] = set()
    with (
        RedisStagingSink.from_url(url, namespace=namespace) as sink,
        RedisStagingSource.from_url(url, namespace=namespace) as source,
    ):
        assert isinstance(sink, StagingSink) and isinstance(source, StagingSource)  # the seed's protocols

        def serve(rollout_id: str) -> list[LedgerRow]:
            seen_threads.add(threading.get_ident())
            return worker_rollout(sink, rollout_id, calls)

        # Every thread waits for all the others before it serves: the stages really run from `threads` threads.
        started = threading.Barrier(min(threads, rollouts))
        with ThreadPoolExecutor(max_workers=threads, initializer=started.wait) as pool:
            rollout_ids = [f"rollout-{r}" for r in range(rollouts)]
            ledgers = dict(zip(rollout_ids, pool.map(serve, rollout_ids), strict=True))
        fetched = 0
        for rollout_id, ledger in ledgers.items():
            finalize(source, rollout_id, ledger)
            fetched += len(ledger)
            sink.clear([key for _, key, _ in ledger])  # consumed: delete the staged records
    return len(ledgers), fetched, len(seen_threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a durable server (default: start a private one)")
    parser.add_argument("--namespace", default="gym-example")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args(argv)

    def go(url: str) -> None:
        done, records, used = run(
            url, namespace=args.namespace, rollouts=args.rollouts, calls=args.calls, threads=args.threads
        )
        print(f"finalized {done} rollouts, {records} records verified and cleared, staged from {used} threads")

    if args.redis_url:
        go(args.redis_url)
    else:
        with DurableServer() as server:
            go(server.url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
