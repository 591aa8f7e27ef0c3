"""Benchmark: the staged-record hot path (digest + msgpack codec) against a per-element baseline.

Run ``python -m sink_tools.bench.codec`` (or ``staging-sink bench codec``). For child
calls (``prev_len`` 4,096, a quarter of each delta is prompt carry) of 256,
2,048 and 16,384 tokens it measures side by side in one run, in ns per token
(best of N, ``time.perf_counter``), under these column names:

* ``build+encode``: ``StagedCallRecord.from_components`` + ``encode_record``;
* ``verified decode``: ``decode_record`` with full verification (every rule, digest recomputed);
* ``sha256 floor``: ``hashlib.sha256`` over the 16 column bytes per token the digest covers;
* ``baseline enc``/``baseline dec``: a straightforward per-element implementation of the same contract
  (``struct.pack`` per element, Python loops), and the codec's speedup over it;
* ``bytes/token``: encoded bytes per token, beside msgpack of the plain lists.

Targets (a PASS/MISS line each): build+encode and verified decode at most 80 ns/token and at least 15x
faster than the baseline; at most 10 bytes/token; for deltas of 2,048 tokens or more.

Large temporary buffers make glibc trim and regrow the heap between
operations; each regrown page costs a page fault, which on small VMs is a
visible share of (a). ``page faults/op`` shows it; run with
``MALLOC_TOP_PAD_=67108864`` in the environment to see the figures without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from sink.contract.codec import CODEC_VERSION, decode_record, encode_record
from sink.contract.digest import (
    CALL_DIGEST_DOMAIN,
    EMPTY_EXTRAS_DIGEST,
    build_staging_delta,
    compute_chain_hash,
    digest_scalar_parts,
    hash_token_ids,
)
from sink.contract.record_schema import STORED_SCALAR_FIELDS
from sink.contract.records import StagedCallRecord, StagedCallSnapshot
from sink_tools.bench import Target, format_targets, progress

__all__ = (
    "DEFAULT_SIZES",
    "TARGET_MIN_TOKENS",
    "baseline_decode",
    "baseline_encode",
    "codec_targets",
    "format_report",
    "main",
    "measure_size",
    "run_codec_benchmark",
    "sample_components",
)

DEFAULT_SIZES = (256, 2048, 16384)
TARGET_MIN_TOKENS = 2048
"""The targets apply to deltas of this many tokens or more (below it, per-record overhead dominates)."""
_VOCAB = 151_936
_PREV_LEN = 4096
_U64 = struct.Struct(">Q")
_F32 = struct.Struct("<f")
_CODE_VALUES = {0x00: 0.0, 0x80: -0.0, 0x3F: 1.0}


def sample_components(tokens: int, *, seed: int = 0) -> dict[str, Any]:
    """``from_components`` keyword arguments of a realistic child call with a *tokens*-token delta."""
    rng = random.Random(seed * 1_000_003 + tokens)
    carry = max(1, tokens // 4)
    prompt = [rng.randrange(_VOCAB) for _ in range(_PREV_LEN + carry)]
    generated = [rng.randrange(_VOCAB) for _ in range(tokens - carry)]
    # engines report float32 log-probabilities; Python holds them as exact floats
    logprobs = [_F32.unpack(_F32.pack(-rng.expovariate(0.7)))[0] for _ in generated]
    ids, mask, log_probs = build_staging_delta(prompt, generated, logprobs, _PREV_LEN)
    return {
        "rollout_id": "bench-rollout",
        "model_call_id": f"call-{tokens}",
        "parent_call_id": "parent-call",
        "mode": "token_in",
        "prev_len": _PREV_LEN,
        "delta_len": tokens,
        "cum_len": _PREV_LEN + tokens,
        "weight_version": 7,
        "token_ids_delta": ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": log_probs,
        "extras": None,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": compute_chain_hash(hash_token_ids(prompt[:_PREV_LEN]), ids),
        "cumulative_hash": hash_token_ids(prompt + generated),
    }


# --- the per-element baseline ------------------------------------------------------


def _baseline_check_columns(ids: list[int], mask: list[float], log_probs: list[float]) -> None:
    if not len(ids) == len(mask) == len(log_probs):
        raise ValueError("columns differ in length")
    for token in ids:
        if type(token) is not int or not 0 <= token < 1 << 64:
            raise ValueError("token ids must be exact ints in [0, 2**64)")
    for m, lp in zip(mask, log_probs, strict=True):
        if type(m) is not float or type(lp) is not float or not math.isfinite(lp):
            raise ValueError("masks and log-probabilities must be finite exact floats")
        if m != 0.0 and m != 1.0:
            raise ValueError("masks must be 0.0 or 1.0")
        if m == 0.0 and lp != 0.0:
            raise ValueError("prompt-carry log probabilities must be 0.0")


def _baseline_digest(fields: dict[str, Any], ids: list[int], mask: list[float], log_probs: list[float]) -> str:
    head, tail = digest_scalar_parts(fields)
    count = _U64.pack(len(ids))
    id_bytes = b"".join([struct.pack(">Q", token) for token in ids])
    mask_bytes = b"".join([struct.pack(">f", m) for m in mask])
    lp_bytes = b"".join([struct.pack(">f", lp) for lp in log_probs])
    payload = [head]
    for column in (id_bytes, mask_bytes, lp_bytes):
        payload += [_U64.pack(8 + len(column)), count, column]
    payload.append(tail)
    return hashlib.sha256(CALL_DIGEST_DOMAIN + b"".join(payload)).hexdigest()


def baseline_encode(components: dict[str, Any]) -> bytes:
    """Validate, digest and encode like ``from_components`` + ``encode_record``, one element at a time."""
    fields = {"schema_version": 2, "digest_version": 2, "extras_digest_version": 1, **components}
    ids, mask, log_probs = fields["token_ids_delta"], fields["token_mask_delta"], fields["generation_log_probs_delta"]
    _baseline_check_columns(ids, mask, log_probs)
    digest = _baseline_digest(fields, ids, mask, log_probs)
    wide = any(token >= 1 << 32 for token in ids)
    exact = all(_F32.unpack(_F32.pack(lp))[0] == lp for lp in log_probs)
    payload: dict[str, Any] = {"v": CODEC_VERSION, "digest": digest}
    payload.update((name, fields[name]) for name in STORED_SCALAR_FIELDS)
    payload["ids_width"] = 8 if wide else 4
    payload["ids"] = b"".join([struct.pack("<Q" if wide else "<I", token) for token in ids])
    payload["mask"] = bytes([struct.pack(">f", m)[0] for m in mask])
    payload["log_prob_width"] = 4 if exact else 8
    payload["log_probs"] = b"".join([struct.pack("<f" if exact else "<d", lp) for lp in log_probs])
    payload["extras"] = fields["extras"]
    StagedCallRecord.model_construct(**fields, digest=digest)  # the record object the fast path also builds
    blob: bytes = msgpack.packb(payload, use_bin_type=True)
    return blob


def baseline_decode(blob: bytes) -> StagedCallSnapshot:
    """Decode and verify like ``decode_record``, one element at a time."""
    obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    n, ids_width, lp_width = obj["delta_len"], obj["ids_width"], obj["log_prob_width"]
    id_format, lp_format = ("<I" if ids_width == 4 else "<Q"), ("<f" if lp_width == 4 else "<d")
    ids = [struct.unpack_from(id_format, obj["ids"], i * ids_width)[0] for i in range(n)]
    mask = [_CODE_VALUES[code] for code in obj["mask"]]
    log_probs = [struct.unpack_from(lp_format, obj["log_probs"], i * lp_width)[0] for i in range(n)]
    _baseline_check_columns(ids, mask, log_probs)
    if _baseline_digest(obj, ids, mask, log_probs) != obj["digest"]:
        raise ValueError("digest does not match staged call contents")
    fields = {name: obj[name] for name in STORED_SCALAR_FIELDS}
    return StagedCallSnapshot.model_construct(
        **fields,
        digest=obj["digest"],
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=log_probs,
        extras=obj["extras"],
    )


# --- measurement -------------------------------------------------------------------


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _best_ns_per_token(operation: Callable[[], object], tokens: int, repeats: int) -> float:
    operation()  # warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        operation()
        best = min(best, time.perf_counter() - start)
    return best / tokens * 1e9


def measure_size(tokens: int, *, repeats: int | None = None) -> dict[str, Any]:
    """Figures for one delta size (see the module docstring for the columns)."""
    fast_repeats = repeats or max(5, min(400, 400_000 // tokens))
    slow_repeats = max(3, fast_repeats // 20)
    components = sample_components(tokens)
    record = StagedCallRecord.from_components(**components)
    blob = encode_record(record)
    if baseline_encode(components) != blob or baseline_decode(blob).model_dump() != decode_record(blob).model_dump():
        raise AssertionError("the baseline disagrees with the codec")
    column_bytes = bytes(16 * tokens)

    faults_before = _minor_faults()
    encode_ns = _best_ns_per_token(
        lambda: encode_record(StagedCallRecord.from_components(**components)), tokens, fast_repeats
    )
    faults = (_minor_faults() - faults_before) / (fast_repeats + 1)
    decode_ns = _best_ns_per_token(lambda: decode_record(blob), tokens, fast_repeats)
    sha_ns = _best_ns_per_token(lambda: hashlib.sha256(column_bytes).digest(), tokens, fast_repeats)
    base_encode_ns = _best_ns_per_token(lambda: baseline_encode(components), tokens, slow_repeats)
    base_decode_ns = _best_ns_per_token(lambda: baseline_decode(blob), tokens, slow_repeats)
    plain = msgpack.packb(record.model_dump(), use_bin_type=True)
    return {
        "tokens": tokens,
        "encode_ns_per_token": encode_ns,
        "decode_ns_per_token": decode_ns,
        "sha256_ns_per_token": sha_ns,
        "baseline_encode_ns_per_token": base_encode_ns,
        "baseline_decode_ns_per_token": base_decode_ns,
        "encode_speedup": base_encode_ns / encode_ns,
        "decode_speedup": base_decode_ns / decode_ns,
        "encode_over_sha256": encode_ns / sha_ns,
        "decode_over_sha256": decode_ns / sha_ns,
        "bytes_per_token": len(blob) / tokens,
        "plain_msgpack_bytes_per_token": len(plain) / tokens,
        "page_faults_per_encode": faults,
    }


def _measure_with_progress(tokens: int, repeats: int | None) -> dict[str, Any]:
    progress(f"codec: {tokens} tokens")
    return measure_size(tokens, repeats=repeats)


def run_codec_benchmark(sizes: Sequence[int] = DEFAULT_SIZES, *, repeats: int | None = None) -> dict[str, Any]:
    """Measure every size; returns ``{"rows": [...], "targets": {...}}`` (see :func:`measure_size`)."""
    return {
        "rows": [_measure_with_progress(tokens, repeats) for tokens in sizes],
        "targets": {"ns_per_token": 80, "speedup": 15, "bytes_per_token": 10},
    }


def codec_targets(report: dict[str, Any]) -> list[Target]:
    """The documented targets, measured for every size."""
    goals = report["targets"]
    targets: list[Target] = []
    for row in report["rows"]:
        if row["tokens"] < TARGET_MIN_TOKENS:
            continue
        size = f"{row['tokens']} tokens"
        targets += [
            Target(f"build+encode, {size}", row["encode_ns_per_token"], "<=", goals["ns_per_token"], "ns/token"),
            Target(f"verified decode, {size}", row["decode_ns_per_token"], "<=", goals["ns_per_token"], "ns/token"),
            Target(f"encode speedup over baseline, {size}", row["encode_speedup"], ">=", goals["speedup"], "x"),
            Target(f"decode speedup over baseline, {size}", row["decode_speedup"], ">=", goals["speedup"], "x"),
            Target(f"encoded size, {size}", row["bytes_per_token"], "<=", goals["bytes_per_token"], "bytes/token"),
        ]
    return targets


_COLUMNS = (
    ("tokens", "tokens", 7, ".0f"),
    ("build+encode", "encode_ns_per_token", 12, ".1f"),
    ("verified decode", "decode_ns_per_token", 15, ".1f"),
    ("sha256 floor", "sha256_ns_per_token", 12, ".1f"),
    ("baseline enc", "baseline_encode_ns_per_token", 12, ".1f"),
    ("baseline dec", "baseline_decode_ns_per_token", 12, ".1f"),
    ("enc speedup", "encode_speedup", 11, ".1f"),
    ("dec speedup", "decode_speedup", 11, ".1f"),
    ("enc/sha256", "encode_over_sha256", 10, ".1f"),
    ("dec/sha256", "decode_over_sha256", 10, ".1f"),
    ("bytes/token", "bytes_per_token", 11, ".2f"),
    ("msgpack B/tok", "plain_msgpack_bytes_per_token", 13, ".2f"),
    ("faults/op", "page_faults_per_encode", 9, ".1f"),
)


def format_report(report: dict[str, Any]) -> str:
    """The figures as an aligned text table with named columns, then one PASS/MISS line per target."""
    header = " ".join(f"{name:>{width}}" for name, _, width, _ in _COLUMNS)
    lines = ["ns per token unless named otherwise, best of N", header]
    lines.extend(" ".join(f"{row[key]:>{width}{spec}}" for _, key, width, spec in _COLUMNS) for row in report["rows"])
    lines.extend(format_targets(codec_targets(report)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.codec [--sizes N ...] [--repeats N] [--json]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench codec", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="delta sizes in tokens")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default: by size)")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    if any(size < 1 for size in args.sizes) or (args.repeats is not None and args.repeats < 1):
        parser.error("sizes and repeats must be positive")
    report = run_codec_benchmark(args.sizes, repeats=args.repeats)
    sys.stdout.write((json.dumps(report, indent=2) if args.json else format_report(report)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
