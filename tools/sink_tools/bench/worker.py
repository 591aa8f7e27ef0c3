"""Benchmark: the worker's per-call cost, side by side with the bare durable stage and the fetch floor.

Run ``python -m sink_tools.bench.worker`` (or ``staging-sink bench worker``). For a 32-turn rollout with 2,048-token
turns it measures, in one run:

* worker CPU per token, begin -> coords with the stage excluded (a sink that acknowledges at once), per
  delta token and per token of the full sequence (the contract's cumulative hash covers the whole sequence);
* the worker's hashing floor, measured in the same run: ``sha256`` over exactly the bytes the contract makes
  every call hash (the full-sequence cumulative-hash input, the call-digest payload, the chain-hash input),
  each built with the public encoders and checked against the staged coordinates;
* the same two per turn: each call's CPU against the ``sha256`` of that call's own inputs (each turn's best of
  the repeats), the worst turn's ratio and turn 1's reported (the cumulative hash grows with the conversation,
  so a late turn's floor is larger; the target holds the worker to it at every turn);
* added latency per call over the bare durable ``stage`` of the same records on one durable server;
* ``staging_chain`` resolution of a 31-call chain (fetch + verify) against the hash-and-fetch floor: a raw
  ``MGET`` of the same bytes plus ``sha256`` over the bytes the contract requires hashing.

Every figure is the best of ``--repeats`` runs (latencies: the lowest per-run median; per-turn figures: each
turn's best). With ``--redis-url`` everything lives under ``--namespace`` (see :mod:`sink_tools.bench`). Targets:
worker CPU at most :data:`MAX_WORKER_TO_FLOOR` times its hashing floor at every turn (checked on the worst turn),
chain resolution at most :data:`MAX_CHAIN_TO_FLOOR` times its floor.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio
import redis.asyncio as aioredis

from sink.contract.packed_record import StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords, StagedCallRecord, StageResult
from sink.keys import record_key
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    DEFAULT_REPEATS,
    BenchNamespace,
    Target,
    add_common_arguments,
    bench_namespace,
    format_targets,
    progress,
    report_on_server,
)
from sink_tools.bench.worker_floor import call_hash_seconds, digest_bytes_per_record, hash_inputs, hash_seconds
from worker.capture import RolloutTokenCapture
from worker.prefix import aresolve_prefix

__all__ = (
    "MAX_CHAIN_TO_FLOOR",
    "MAX_WORKER_TO_FLOOR",
    "AcknowledgingSink",
    "format_report",
    "main",
    "per_turn_figures",
    "run_worker_benchmark",
    "worker_targets",
)

MAX_WORKER_TO_FLOOR = 2.0
"""Target: at every turn, the worker's CPU on the call (stage excluded) at most this many times the contract's hashing
floor of that call (checked on the worst turn)."""
MAX_CHAIN_TO_FLOOR = 4.0
"""Target: ``staging_chain`` resolution at most this many times the fetch-and-hash floor."""


class AcknowledgingSink:
    """A sink that acknowledges at once: isolates the worker's own CPU from storage."""

    async def stage(self, record: StageableRecord) -> StageResult:
        return StageResult(ok=True, staging_key=record.staging_key)


def _turns(turns: int, tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Per turn: (new prompt ids, generated ids, generated log-probs); 1/8 of a turn is prompt carry."""
    carry = tokens // 8
    out = []
    for turn in range(turns):
        prompt_new = [(turn * 7919 + i * 31) % 150_000 for i in range(carry if turn else carry * 2)]
        generated = [(turn * 104729 + i * 17) % 150_000 for i in range(tokens - len(prompt_new))]
        logprobs = [-((i % 97) + 1) / 64.0 for i in range(len(generated))]
        out.append((prompt_new, generated, logprobs))
    return out


async def _run_rollout(
    capture: RolloutTokenCapture,
    rollout_id: str,
    plan: list[tuple[list[int], list[int], list[float]]],
    *,
    fresh_prompt: bool = False,
) -> tuple[list[Any], list[float]]:
    """Drive one rollout through *capture*; return the coords and each call's begin->coords seconds.

    With *fresh_prompt* the engine echoes the prompt as new int objects of equal value (as a real
    engine does), built before the clock starts.
    """
    sequence: list[int] = []
    parent = None
    coords_list, seconds = [], []
    for turn, (prompt_new, generated, logprobs) in enumerate(plan):
        if parent is None:
            admission = CaptureAdmission(rollout_id=rollout_id, model_call_id=f"c{turn}", mode="text")
        else:
            admission = CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id=f"c{turn}",
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                staging_chain=[f"{rollout_id}/c{k}" for k in range(turn)],
                parent_chain_hash=parent.chain_hash,
            )
        prompt = sequence + prompt_new
        if fresh_prompt:
            prompt = [token + 0 for token in prompt]  # equal values, distinct objects (ids > 256)
        start = time.perf_counter()
        call = await capture.abegin_call(admission, prefix_token_ids=sequence if parent is not None else None)
        coords = await capture.acomplete_call(
            call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=logprobs
        )
        seconds.append(time.perf_counter() - start)
        if coords.disposition != "staged":
            raise RuntimeError(f"the benchmark's call {admission.model_call_id} was not staged")
        coords_list.append(coords)
        sequence = prompt + generated
        parent = coords
    return coords_list, seconds


def _renamed(record: StagedCallRecord, rollout_id: str) -> StagedCallRecord:
    """The same call staged under another rollout id (its digest recomputed)."""
    return StagedCallRecord.from_components(
        rollout_id=rollout_id,
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        mode=record.mode,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        token_ids_delta=list(record.token_ids_delta),
        token_mask_delta=list(record.token_mask_delta),
        generation_log_probs_delta=list(record.generation_log_probs_delta),
        extras=record.extras,
        extras_digest=record.extras_digest,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
    )


async def _durable_run(
    url: str, namespace: str, plan: list[tuple[list[int], list[int], list[float]]]
) -> tuple[list[CommitCoords], tuple[list[float], list[float]], float, float]:
    """One rollout staged durably through the worker, the same records staged bare, and a chain resolution
    against its floor: (coords, (call seconds, bare stage seconds), resolve seconds, floor seconds)."""
    turns = len(plan)
    async with (
        AsyncRedisStagingSink.from_url(url, namespace=namespace) as sink,
        AsyncRedisStagingSource.from_url(url, namespace=namespace) as source,
        aioredis.Redis.from_url(url) as client,
    ):
        capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 1)
        coords, with_capture = await _run_rollout(capture, "lat", plan)
        records = await source.fetch([c.staging_key for c in coords])
        bare = []
        for record in [_renamed(r, "bare") for r in records]:
            start = time.perf_counter()
            if not (await sink.stage(record)).ok:  # the same records, written fresh
                raise RuntimeError("a bare stage failed during the benchmark")
            bare.append(time.perf_counter() - start)
        chain_admission = CaptureAdmission(
            rollout_id="lat",
            model_call_id="next",
            parent_call_id=coords[turns - 2].model_call_id,
            prev_len=coords[turns - 2].cum_len,
            mode="token_in",
            staging_chain=[c.staging_key for c in coords[: turns - 1]],
            parent_chain_hash=coords[turns - 2].chain_hash,
        )
        chain_keys = [record_key(namespace, c.staging_key) for c in coords[: turns - 1]]
        payload = bytes(sum(digest_bytes_per_record(len(p) + len(g)) for p, g, _ in plan[: turns - 1]))
        resolve, floor = [], []
        for _ in range(3):
            start = time.perf_counter()
            prefix = await aresolve_prefix(chain_admission, source)
            resolve.append(time.perf_counter() - start)
            start = time.perf_counter()
            await client.mget(chain_keys)
            hashlib.sha256(payload).digest()
            floor.append(time.perf_counter() - start)
        if len(prefix) != chain_admission.prev_len:
            raise RuntimeError("chain resolution returned a prefix of the wrong length")
    return coords, (with_capture, bare), min(resolve), min(floor)


async def run_worker_benchmark(
    url: str,
    *,
    turns: int = 32,
    tokens: int = 2048,
    repeats: int = DEFAULT_REPEATS,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
) -> dict[str, Any]:
    """Run the three measurements against the durable server at *url*, in *namespace* only (deleted at the
    end; a namespace that already has keys is refused).

    :raises BenchmarkNamespaceInUseError: *namespace* already has keys on that server.
    """
    if repeats < 1 or turns < 2:
        raise ValueError("repeats must be at least 1 and turns at least 2")
    async with bench_namespace(url, namespace) as space:  # refused before any measurement
        return await _measure(space, turns, tokens, repeats)


async def _measure(space: BenchNamespace, turns: int, tokens: int, repeats: int) -> dict[str, Any]:
    url, namespace = space.url, space.namespace
    plan = _turns(turns, tokens)
    delta_tokens = sum(len(p) + len(g) for p, g, _ in plan)
    full_tokens = sum(sum(len(p) + len(g) for p, g, _ in plan[: k + 1]) for k in range(turns))
    cpu, fresh_cpu, floor_cpu = [], [], []
    turn_cpu: list[list[float]] = []  # per repeat, each call's seconds
    turn_floor: list[list[float]] = []
    floor_inputs: list[tuple[bytes, bytes, bytes]] = []
    for repeat in range(repeats):
        progress(f"worker: CPU per call, stage excluded, repeat {repeat + 1}/{repeats}")
        capture = RolloutTokenCapture(sink=AcknowledgingSink(), weight_version_fn=lambda: 1)
        cpu_coords, seconds = await _run_rollout(capture, f"cpu{repeat}", plan)
        cpu.append(sum(seconds))
        turn_cpu.append(seconds)
        capture = RolloutTokenCapture(sink=AcknowledgingSink(), weight_version_fn=lambda: 1)
        fresh_coords, seconds = await _run_rollout(capture, f"cpu{repeat}", plan, fresh_prompt=True)
        fresh_cpu.append(sum(seconds))
        if [c.digest for c in fresh_coords] != [c.digest for c in cpu_coords]:
            raise RuntimeError("fresh prompt objects gave other coordinates")
        if not floor_inputs:
            floor_inputs = hash_inputs(plan, cpu_coords)
        floor_cpu.append(hash_seconds(floor_inputs))  # interleaved with the worker runs: same conditions
        turn_floor.append(call_hash_seconds(floor_inputs))
    best_cpu, best_fresh, best_floor = min(cpu), min(fresh_cpu), min(floor_cpu)

    latency_runs, resolve, floor = [], [], []
    for repeat in range(repeats):
        progress(f"worker: durable call latency and chain resolution, repeat {repeat + 1}/{repeats}")
        await space.clear()
        coords, run_latency, run_resolve, run_floor = await _durable_run(url, namespace, plan)
        latency_runs.append(run_latency)
        resolve.append(run_resolve)
        floor.append(run_floor)
    call_p50 = min(statistics.median(run[0]) for run in latency_runs)  # each figure: the best run's
    bare_p50 = min(statistics.median(run[1]) for run in latency_runs)
    chain_tokens = coords[turns - 2].cum_len
    return {
        "repeats": repeats,
        "turns": turns,
        "tokens_per_turn": tokens,
        "worker_cpu_ns_per_delta_token": best_cpu / delta_tokens * 1e9,
        "worker_cpu_ns_per_full_token": best_cpu / full_tokens * 1e9,
        "hash_floor_ns_per_delta_token": best_floor / delta_tokens * 1e9,
        "hash_floor_ns_per_full_token": best_floor / full_tokens * 1e9,
        "worker_to_floor_ratio": best_cpu / best_floor,
        "fresh_prompt_cpu_ns_per_delta_token": best_fresh / delta_tokens * 1e9,
        "fresh_prompt_to_floor_ratio": best_fresh / best_floor,
        "call_latency_ms_p50": call_p50 * 1e3,
        "bare_stage_latency_ms_p50": bare_p50 * 1e3,
        "added_latency_ms_p50": (call_p50 - bare_p50) * 1e3,
        "chain_resolution_ms": min(resolve) * 1e3,
        "chain_floor_ms": min(floor) * 1e3,
        "chain_ratio": min(resolve) / min(floor),
        "chain_tokens": chain_tokens,
        **per_turn_figures(turn_cpu, turn_floor),
    }


def per_turn_figures(cpu: Sequence[Sequence[float]], floor: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Per turn, the worker's CPU and its hashing floor, each the best of the repeats (*cpu*, *floor*: per repeat,
    each call's seconds), their ratio, and the worst turn's and turn 1's ratios (turns counted from 1).

    :raises ValueError: no repeat, or repeats of different lengths.
    """
    if not cpu or not floor or len({len(run) for run in (*cpu, *floor)}) != 1 or not cpu[0]:
        raise ValueError("per-turn figures need at least one repeat of each, all of the same turns")
    best_cpu = [min(turn) for turn in zip(*cpu, strict=True)]
    best_floor = [min(turn) for turn in zip(*floor, strict=True)]
    ratios = [c / f if f > 0 else float("inf") for c, f in zip(best_cpu, best_floor, strict=True)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return {
        "turn_worker_cpu_us": [seconds * 1e6 for seconds in best_cpu],
        "turn_hash_floor_us": [seconds * 1e6 for seconds in best_floor],
        "turn_worker_to_floor_ratio": ratios,
        "worst_turn": worst + 1,
        "worst_turn_worker_to_floor_ratio": ratios[worst],
        "first_turn_worker_to_floor_ratio": ratios[0],
    }


def worker_targets(report: dict[str, Any]) -> list[Target]:
    """The documented targets, measured."""
    return [
        Target(
            f"worker CPU / hashing floor at every turn (worst: turn {report['worst_turn']} of {report['turns']})",
            report["worst_turn_worker_to_floor_ratio"],
            "<=",
            MAX_WORKER_TO_FLOOR,
            "x",
        ),
        Target("staging_chain resolution / floor", report["chain_ratio"], "<=", MAX_CHAIN_TO_FLOOR, "x"),
    ]


def _turn_lines(r: dict[str, Any]) -> list[str]:
    """Turn 1 (the root call), the last turn and the worst turn: the worker's CPU against that call's floor."""
    last, worst = r["turns"], r["worst_turn"]

    def turn(index: int) -> str:
        cpu, floor = r["turn_worker_cpu_us"][index - 1], r["turn_hash_floor_us"][index - 1]
        return f"{cpu:.1f} vs {floor:.1f} us = {r['turn_worker_to_floor_ratio'][index - 1]:.2f}x"

    return [
        "  per turn, worker CPU vs the sha256 of that call's contract inputs (each turn's best of the runs):",
        f"    turn 1 (root): {turn(1)}; turn {last} (last): {turn(last)}; worst, turn {worst}: {turn(worst)}",
    ]


def format_report(report: dict[str, Any]) -> str:
    """Human-readable lines with the ratios."""
    r = report
    lines = [
        f"{r['turns']}-turn rollout, {r['tokens_per_turn']}-token turns, best of {r['repeats']} runs",
        (
            f"  worker CPU, begin -> coords, stage excluded: {r['worker_cpu_ns_per_delta_token']:.1f} ns/delta token"
            f" ({r['worker_cpu_ns_per_full_token']:.1f} ns per token of the full sequence the contract hashes)"
        ),
        (
            f"  hashing floor (sha256 of the contract's per-call inputs): {r['hash_floor_ns_per_delta_token']:.1f}"
            f" ns/delta token ({r['hash_floor_ns_per_full_token']:.1f} per full token): worker"
            f" = {r['worker_to_floor_ratio']:.2f}x floor"
        ),
        *_turn_lines(r),
        (
            f"  the same with the engine echoing the prompt as fresh int objects: "
            f"{r['fresh_prompt_cpu_ns_per_delta_token']:.1f} ns/delta token = {r['fresh_prompt_to_floor_ratio']:.2f}x floor"
        ),
        (
            f"  call latency p50 {r['call_latency_ms_p50']:.2f} ms vs bare durable stage p50 "
            f"{r['bare_stage_latency_ms_p50']:.2f} ms: added {r['added_latency_ms_p50']:.2f} ms per call"
        ),
        (
            f"  staging_chain resolution ({r['turns'] - 1} calls, {r['chain_tokens']} tokens): "
            f"{r['chain_resolution_ms']:.2f} ms vs floor {r['chain_floor_ms']:.2f} ms = {r['chain_ratio']:.2f}x"
        ),
        *format_targets(worker_targets(r)),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.worker [--redis-url URL] [--namespace NS] [--json]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench worker", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--turns", type=int, default=32, help="calls in the rollout (default: 32)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per turn (default: 2048)")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.tokens < 16 or args.repeats < 1:
        parser.error("--turns must be at least 2, --tokens at least 16 and --repeats at least 1")

    def run(url: str) -> dict[str, Any]:
        return anyio.run(
            lambda: run_worker_benchmark(
                url, turns=args.turns, tokens=args.tokens, repeats=args.repeats, namespace=args.namespace
            )
        )

    return report_on_server(args.redis_url, lambda url, _server: run(url), format_report, as_json=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
