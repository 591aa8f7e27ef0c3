"""The v2 digest contract (contract §4), byte-identical to the reference.

Every hash is ``SHA-256(DOMAIN || payload)`` rendered as 64 lowercase hex
characters. The byte encodings live in :mod:`sink.contract.digest_encoding`, the
extras digest in :mod:`sink.contract.extras_digest` (both re-exported here), and the
call digest's inputs, their order and encodings in the field table of
:mod:`sink.contract.record_schema`.

The public functions check everything (contract §4.3). Record validators,
which have already proved types and rules 1-8, hash pre-packed columns via
:func:`staging_digest_from_packed` (see :mod:`sink.contract._packed`); the payload
layout is the same :func:`digest_scalar_parts` head + framed columns + tail
either way.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from sink.contract._packed import Buffers, is_token_id_list
from sink.contract.digest_encoding import (
    U64,
    encode_f32s,
    encode_text,
    encode_token_ids,
    encode_u64,
    hex_bytes,
    is_digest_hex,
    length_prefixed,
)
from sink.contract.extras_digest import EMPTY_EXTRAS_DIGEST, EXTRAS_DIGEST_DOMAIN, compute_extras_digest
from sink.contract.record_schema import (
    DIGEST_HEAD_INPUTS,
    DIGEST_TAIL_INPUTS,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    SUPPORTED_VERSIONS,
    lineage_problem,
    unsupported_version,
)

__all__ = (
    "CALL_DIGEST_DOMAIN",
    "CHAIN_HASH_DOMAIN",
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_DOMAIN",
    "EXTRAS_DIGEST_VERSION",
    "PREFIX_HASH_DOMAIN",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "build_staging_delta",
    "chain_hash_of_packed",
    "check_mask_values",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "digest_scalar_parts",
    "encode_f32s",
    "encode_token_ids",
    "hash_packed_token_ids",
    "hash_token_ids",
    "is_digest_hex",
    "is_token_id_list",
    "staging_digest_from_packed",
)

CALL_DIGEST_DOMAIN = b"nemo-gym-staging-call-v2"
PREFIX_HASH_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_HASH_DOMAIN = b"nemo-gym-staging-chain-v1"

_MASK_VALUES = frozenset({0.0, 1.0})
_ZERO_ONLY = frozenset({0.0})
_MODES = ("text", "token_in")


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """Cumulative (prefix) hash of a full token sequence (contract §4.4)."""
    return hashlib.sha256(PREFIX_HASH_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def hash_packed_token_ids(parts: Sequence[bytes], count: int) -> str:
    """:func:`hash_token_ids` of ids already packed as u64 big-endian (*parts* concatenated, *count* ids)."""
    digest = hashlib.sha256(PREFIX_HASH_DOMAIN + U64.pack(count))
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _chain_parent(parent_chain_hash: str | None) -> bytes:
    return b"\x00" if parent_chain_hash is None else b"\x01" + hex_bytes(parent_chain_hash)


def chain_hash_of_packed(parent_chain_hash: str | None, ids_u64be: bytes) -> str:
    """:func:`compute_chain_hash` of a delta already packed as u64 big-endian ids."""
    digest = hashlib.sha256(CHAIN_HASH_DOMAIN + _chain_parent(parent_chain_hash) + U64.pack(len(ids_u64be) // 8))
    digest.update(ids_u64be)
    return digest.hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """Chain hash of one delta linked to its parent's chain hash (contract §4.5)."""
    parent = _chain_parent(parent_chain_hash)
    return hashlib.sha256(CHAIN_HASH_DOMAIN + parent + encode_token_ids(token_ids_delta)).hexdigest()


def check_mask_values(token_mask_delta: Sequence[float], generation_log_probs_delta: Sequence[float]) -> None:
    """Rules 7 and 8 of contract §3.3, shared by the digest pre-checks and validators.

    :raises ValueError: a mask is not 0.0/1.0, or a carry (mask 0.0)
        log-probability is not 0.0.
    """
    if not set(token_mask_delta) <= _MASK_VALUES:
        raise ValueError("masks must be 0.0 or 1.0")
    carry_log_probs = itertools.compress(generation_log_probs_delta, map(operator.not_, token_mask_delta))
    if not set(carry_log_probs) <= _ZERO_ONLY:
        raise ValueError("prompt-carry log probabilities must be 0.0")


# --- the call digest's scalar inputs, encoded as the field table says -------------------


def _version_byte(value: object) -> bytes:
    return bytes((value,))  # type: ignore[arg-type]  # a checked version: an int in [0, 256)


def _optional_text(value: object) -> bytes:
    return b"\x00" if value is None else b"\x01" + encode_text(value)


def _present_hex(value: object) -> bytes:
    return b"\x01" + hex_bytes(value)


_ENCODERS: Final[dict[str, Callable[[Any], bytes]]] = {
    "version": _version_byte,
    "text": encode_text,
    "optional_text": _optional_text,
    "u64": encode_u64,
    "hex": hex_bytes,
    "present_hex": _present_hex,
}
# Per payload part (before / after the columns): one getter for the field values, their encoders in order.
_HEAD: Final = (
    operator.itemgetter(*(name for name, _ in DIGEST_HEAD_INPUTS)),
    [_ENCODERS[k] for _, k in DIGEST_HEAD_INPUTS],
)
_TAIL: Final = (
    operator.itemgetter(*(name for name, _ in DIGEST_TAIL_INPUTS)),
    [_ENCODERS[k] for _, k in DIGEST_TAIL_INPUTS],
)


def digest_scalar_parts(fields: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """The call-digest payload before the columns (fields 1-11) and after them (contract §4.3).

    *fields* maps at least every scalar digest input by name (a record's ``__dict__`` will do).

    :raises ValueError: a u64 or hex field is invalid.
    :raises TypeError: an id field is not a ``str``.
    """
    return _encode(_HEAD, fields), _encode(_TAIL, fields)


def _encode(part: tuple[operator.itemgetter[Any], list[Callable[[Any], bytes]]], fields: Mapping[str, Any]) -> bytes:
    values, encoders = part
    return b"".join(map(operator.call, encoders, values(fields)))


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """Call digest of one staged delta (contract §4.3).

    :raises ValueError: a pre-check of contract §4.3 fails.
    :raises TypeError: an id field is not a ``str``.
    """
    scalars = {
        "schema_version": schema_version,
        "digest_version": digest_version,
        "extras_digest_version": extras_digest_version,
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "parent_call_id": parent_call_id,
        "mode": mode,
        "prev_len": prev_len,
        "delta_len": delta_len,
        "cum_len": cum_len,
        "weight_version": weight_version,
        "extras_digest": extras_digest,
        "chain_hash": chain_hash,
        "cumulative_hash": cumulative_hash,
    }
    for name, expected in SUPPORTED_VERSIONS.items():
        if problem := unsupported_version(name, scalars[name], expected):
            raise ValueError(problem)
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be None or non-empty")
    if mode not in _MODES:
        raise ValueError(f"unknown capture mode: {mode!r}")
    if problem := lineage_problem(parent_call_id, prev_len, mode):
        raise ValueError(problem)
    if delta_len == 0:
        raise ValueError("a staged delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError("delta_len must equal the number of token ids")
    n = len(token_ids_delta)
    if len(token_mask_delta) != n or len(generation_log_probs_delta) != n:
        raise ValueError("token, mask and log-probability columns must have equal length")
    check_mask_values(token_mask_delta, generation_log_probs_delta)
    if type(cum_len) is not int or type(prev_len) is not int or type(delta_len) is not int:
        raise ValueError("lengths must be exact ints")
    if cum_len != prev_len + delta_len:
        raise ValueError("cum_len must equal prev_len + delta_len")
    hex_bytes(extras_digest)  # reported before the other fields
    head = _encode(_HEAD, scalars)
    ids = encode_token_ids(token_ids_delta)
    mask = encode_f32s(token_mask_delta)
    log_probs = encode_f32s(generation_log_probs_delta)
    tail = _encode(_TAIL, scalars)
    digest = hashlib.sha256(CALL_DIGEST_DOMAIN)
    for part in (head, length_prefixed(ids), length_prefixed(mask), length_prefixed(log_probs), tail):
        digest.update(part)
    return digest.hexdigest()


def _nbytes(pieces: Buffers) -> int:
    # every piece is a byte-format buffer, so len() counts bytes
    return sum(map(len, pieces))


def staging_digest_from_packed(
    fields: Mapping[str, Any], ids_u64be: Buffers, mask_f32be: Buffers, lp_f32be: Buffers
) -> str:
    """Call digest from columns already packed in their digest form, each given in pieces.

    *fields* maps every scalar digest input by name (a record's ``__dict__``,
    or a stored blob's scalars as decoded: they need not be validated, since
    the scalar pre-checks here and the encoders raise on every value the
    record's scalar fields refuse). For callers that have proved rules 6-8
    and the column pre-checks of contract §4.3 (exact types, ranges, equal
    lengths, binary32 range) themselves. The caller must fall back to
    :func:`compute_staging_digest` on any exception, which raises the precise
    contract error.

    :raises ValueError: a scalar pre-check fails or a column has the wrong size.
    :raises TypeError: an id field is not a ``str``.
    """
    parent_call_id, prev_len, delta_len = fields["parent_call_id"], fields["prev_len"], fields["delta_len"]
    mode = fields["mode"]
    columns = (ids_u64be, mask_f32be, lp_f32be)
    sizes = tuple(map(_nbytes, columns))
    if (
        unsupported_version("schema_version", fields["schema_version"], STAGING_SCHEMA_VERSION)
        or unsupported_version("digest_version", fields["digest_version"], STAGING_DIGEST_VERSION)
        or unsupported_version("extras_digest_version", fields["extras_digest_version"], EXTRAS_DIGEST_VERSION)
        or not fields["rollout_id"]
        or not fields["model_call_id"]
        or parent_call_id == ""
        or mode not in _MODES
        or lineage_problem(parent_call_id, prev_len, mode)
        or delta_len == 0
        or fields["cum_len"] != prev_len + delta_len
        or sizes != (8 * delta_len, 4 * delta_len, 4 * delta_len)
    ):
        raise ValueError("a call-digest pre-check failed")
    head, tail = digest_scalar_parts(fields)
    count = U64.pack(delta_len)
    digest = hashlib.sha256(CALL_DIGEST_DOMAIN)
    digest.update(head)
    for column, size in zip(columns, sizes, strict=True):
        digest.update(U64.pack(8 + size) + count)
        for piece in column:
            digest.update(piece)
    digest.update(tail)
    return digest.hexdigest()


def build_staging_delta(
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    prev_len: int,
) -> tuple[list[int], list[float], list[float]]:
    """Build ``(ids, mask, logprobs)`` of one call's delta (contract §5.4).

    :raises ValueError: ``prev_len`` outside ``[0, len(prompt_ids)]``, the
        generation columns differ in length, or the delta is empty.
    """
    if type(prev_len) is not int or prev_len < 0 or prev_len > len(prompt_ids):
        raise ValueError(f"prev_len {prev_len!r} is outside [0, {len(prompt_ids)}]")
    if len(generated_ids) != len(generated_logprobs):
        raise ValueError("generated ids and log-probabilities differ in length")
    carry = len(prompt_ids) - prev_len
    ids = list(prompt_ids[prev_len:])
    ids.extend(generated_ids)
    if not ids:
        raise ValueError("a staged delta must contain at least one token")
    mask = [0.0] * carry + [1.0] * len(generated_ids)
    logprobs = [0.0] * carry
    logprobs.extend(generated_logprobs)
    return ids, mask, logprobs
