"""The worker benchmark's floors: exactly the bytes the contract makes every call hash, rebuilt with the public
encoders and checked against the staged coordinates (contract §4.3-§4.5), and the bytes a chain fetch must hash."""

from __future__ import annotations

import hashlib
import struct
import time

from sink.contract.digest import (
    CALL_DIGEST_DOMAIN,
    CHAIN_HASH_DOMAIN,
    EMPTY_EXTRAS_DIGEST,
    PREFIX_HASH_DOMAIN,
    encode_f32s,
    encode_token_ids,
)
from sink.contract.records import CommitCoords

__all__ = ("call_hash_inputs", "call_hash_seconds", "digest_bytes_per_record", "hash_inputs", "hash_seconds")

_U64 = struct.Struct(">Q")


def _text(value: str) -> bytes:
    raw = value.encode()
    return _U64.pack(len(raw)) + raw


def _lp(payload: bytes) -> bytes:
    return _U64.pack(len(payload)) + payload


def call_hash_inputs(
    coords: CommitCoords,
    parent_chain: str | None,
    full: list[int],
    columns: tuple[list[int], list[float], list[float]],
) -> tuple[bytes, bytes, bytes]:
    """The exact sha256 inputs of one call (contract §4.3-§4.5), each checked against *coords*.

    :raises RuntimeError: a rebuilt input does not hash to the staged value (the floor would be wrong).
    """
    ids, mask, logprobs = columns
    cumulative = PREFIX_HASH_DOMAIN + encode_token_ids(full)
    link = b"\x00" if parent_chain is None else b"\x01" + bytes.fromhex(parent_chain)
    chain = CHAIN_HASH_DOMAIN + link + encode_token_ids(ids)
    if coords.parent_call_id is None:
        parent_field, mode = b"\x00", "text"
    else:
        parent_field, mode = b"\x01" + _text(coords.parent_call_id), "token_in"
    lengths = (coords.prev_len, coords.delta_len, coords.cum_len, coords.weight_version)
    call = b"".join(
        (
            CALL_DIGEST_DOMAIN,
            bytes((2, 2, 1)),
            _text(coords.rollout_id),
            _text(coords.model_call_id),
            parent_field,
            _text(mode),
            *map(_U64.pack, lengths),
            _lp(encode_token_ids(ids)),
            _lp(encode_f32s(mask)),
            _lp(encode_f32s(logprobs)),
            bytes.fromhex(EMPTY_EXTRAS_DIGEST),
            b"\x01" + bytes.fromhex(str(coords.chain_hash)),
            b"\x01" + bytes.fromhex(str(coords.cumulative_hash)),
        )
    )
    for data, expected in ((cumulative, coords.cumulative_hash), (chain, coords.chain_hash), (call, coords.digest)):
        if hashlib.sha256(data).hexdigest() != expected:
            raise RuntimeError("a rebuilt hash input does not match the staged coordinates")
    return cumulative, call, chain


def hash_inputs(
    plan: list[tuple[list[int], list[int], list[float]]], coords: list[CommitCoords]
) -> list[tuple[bytes, bytes, bytes]]:
    """Per call of the benchmark rollout, the bytes the contract makes the worker hash."""
    out: list[tuple[bytes, bytes, bytes]] = []
    sequence: list[int] = []
    parent_chain: str | None = None
    for (prompt_new, generated, logprobs), call_coords in zip(plan, coords, strict=True):
        ids = prompt_new + generated
        mask = [0.0] * len(prompt_new) + [1.0] * len(generated)
        sequence = sequence + ids
        columns = (ids, mask, [0.0] * len(prompt_new) + logprobs)
        out.append(call_hash_inputs(call_coords, parent_chain, sequence, columns))
        parent_chain = call_coords.chain_hash
    return out


def hash_seconds(inputs: list[tuple[bytes, bytes, bytes]]) -> float:
    """Seconds to sha256 every call's inputs once (each input one contiguous buffer)."""
    start = time.perf_counter()
    for parts in inputs:
        for data in parts:
            hashlib.sha256(data).digest()
    return time.perf_counter() - start


def call_hash_seconds(inputs: list[tuple[bytes, bytes, bytes]]) -> list[float]:
    """Per call, the seconds to sha256 its inputs once: the hashing floor of each turn."""
    seconds = []
    for parts in inputs:
        start = time.perf_counter()
        for data in parts:
            hashlib.sha256(data).digest()
        seconds.append(time.perf_counter() - start)
    return seconds


def digest_bytes_per_record(tokens: int) -> int:
    # call digest payload (16 B/token + header) + chain hash input (8 B/token) + cumulative share (8 B/token)
    return 200 + 32 * tokens
