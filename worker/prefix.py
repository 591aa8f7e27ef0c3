"""Prefix resolution for ``token_in`` admissions (contract §5.2, §10.8).

An admission carries its prefix inline or by reference (``staging_chain``).
By reference, the worker fetches the chain from a :class:`~sink.contract.protocols.StagingSource`
and verifies it before trusting a single id: the deltas must be contiguous,
every snapshot's ``chain_hash`` must equal the running chain hash, the total
length must be ``prev_len``, the last link must be the admission's
``parent_chain_hash`` and the concatenation must hash to the parent's
``cumulative_hash``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sink.contract.digest import chain_hash_of_packed, compute_chain_hash, hash_packed_token_ids, hash_token_ids
from sink.contract.packed import PackedSnapshot, ids_u64be, unpack_list
from sink.contract.record_form import cached_packed_columns
from sink.contract.records import CaptureAdmission, StagedCallBaseSnapshot
from worker.errors import PrefixResolutionError

__all__ = ("aresolve_prefix", "fetch_operation", "inline_prefix", "resolve_prefix", "verify_staging_chain")


def _packed_chain_ids(position: int, snapshot: object) -> tuple[int, bytes | None]:
    """``(delta_len, ids as u64 big-endian or None)`` of one fetched chain record.

    A :class:`~sink.contract.packed.PackedSnapshot` (from ``fetch_packed``) carries the digest form of
    its ids; a model snapshot fresh from a source carries the packed columns its decoding proved.
    """
    if isinstance(snapshot, PackedSnapshot):
        return snapshot.delta_len, snapshot.ids_u64be
    if not isinstance(snapshot, StagedCallBaseSnapshot):
        raise PrefixResolutionError(f"chain record {position} is a {type(snapshot).__name__}, not a snapshot")
    packed = cached_packed_columns(snapshot)
    if packed is None:
        return len(snapshot.token_ids_delta), None
    return len(snapshot.token_ids_delta), ids_u64be(packed.ids_le, packed.ids_width, packed.length)


def verify_staging_chain(
    admission: CaptureAdmission, snapshots: Sequence[StagedCallBaseSnapshot | PackedSnapshot]
) -> list[int]:
    """Check fetched chain snapshots against *admission* and return the prefix ids (§5.2).

    Snapshots may be models (``fetch``) or :class:`~sink.contract.packed.PackedSnapshot` (``fetch_packed``):
    for packed ones the hashes run over their bytes and the prefix is built from the very bytes hashed.

    :raises PrefixResolutionError: wrong count, a gap in the chain, a
        snapshot whose chain hash does not link, a total length other than
        ``prev_len``, a last link other than ``parent_chain_hash``, or a
        concatenation whose cumulative hash differs from the last record's.
    """
    chain = admission.staging_chain
    if len(snapshots) != len(chain) or not chain:
        raise PrefixResolutionError(f"fetched {len(snapshots)} chain records for {len(chain)} staging keys")
    running_hash: str | None = None
    running_len = 0
    # Hashing packed ids skips re-packing every id (same hashes, same checks).
    packed_ids: list[bytes] | None = []
    for position, snapshot in enumerate(snapshots):
        length, ids_be = _packed_chain_ids(position, snapshot)
        if snapshot.prev_len != running_len:
            raise PrefixResolutionError(
                f"chain record {position} starts at {snapshot.prev_len}, expected {running_len}"
            )
        if ids_be is not None and packed_ids is not None:
            packed_ids.append(ids_be)
            running_hash = chain_hash_of_packed(running_hash, ids_be)
        else:
            packed_ids = None
            running_hash = compute_chain_hash(running_hash, snapshot.token_ids_delta)
        if snapshot.chain_hash != running_hash:
            raise PrefixResolutionError(
                f"chain record {position} ({chain[position]!r}) does not link: chain hash mismatch"
            )
        running_len += length
    if running_len != admission.prev_len:
        raise PrefixResolutionError(f"chain length {running_len} != prev_len {admission.prev_len}")
    if running_hash != admission.parent_chain_hash:
        raise PrefixResolutionError("chain hash of the fetched chain != the admission's parent_chain_hash")
    if packed_ids is not None:
        cumulative = hash_packed_token_ids(packed_ids, running_len)
        prefix = unpack_list(packed_ids, "Q", big_endian=True)
    else:
        prefix = list(itertools.chain.from_iterable(snapshot.token_ids_delta for snapshot in snapshots))
        cumulative = hash_token_ids(prefix)
    if cumulative != snapshots[-1].cumulative_hash:
        raise PrefixResolutionError("cumulative hash of the fetched chain != the parent's cumulative_hash")
    return prefix


def fetch_operation(source: Any) -> Callable[[list[str]], Any]:
    """The source's ``fetch_packed`` when it has one (no per-token objects until the prefix list), else ``fetch``."""
    packed = getattr(source, "fetch_packed", None)
    return packed if callable(packed) else source.fetch  # type: ignore[no-any-return]


def inline_prefix(admission: CaptureAdmission) -> list[int] | None:
    """The prefix of *admission* when no fetch is needed (``[]`` for a text root), else ``None``.

    :raises TypeError: *admission* is not a :class:`CaptureAdmission`.
    """
    if not isinstance(admission, CaptureAdmission):
        raise TypeError(f"expected a CaptureAdmission, got {type(admission).__name__}")
    if admission.mode == "text":
        return []
    if admission.required_prefix_token_ids:
        return list(admission.required_prefix_token_ids)
    return None


@contextmanager
def _missing_chain_record() -> Iterator[None]:
    """A ``KeyError`` from the chain fetch becomes a :class:`PrefixResolutionError`."""
    try:
        yield
    except KeyError as exc:
        raise PrefixResolutionError(f"staging chain record missing: {exc}") from exc


def resolve_prefix(admission: CaptureAdmission, source: Any) -> list[int]:
    """Resolve *admission*'s prefix, fetching and verifying its staging chain if needed (§5.2).

    :raises TypeError: *admission* is not a :class:`CaptureAdmission`.
    :raises PrefixResolutionError: a chain key is missing or the chain does
        not verify (other source errors propagate unchanged).
    """
    prefix = inline_prefix(admission)
    if prefix is not None:
        return prefix
    with _missing_chain_record():
        snapshots = fetch_operation(source)(list(admission.staging_chain))
    return verify_staging_chain(admission, snapshots)


async def aresolve_prefix(admission: CaptureAdmission, source: Any) -> list[int]:
    """Async twin of :func:`resolve_prefix` over an ``AsyncStagingSource``.

    :raises TypeError: *admission* is not a :class:`CaptureAdmission`.
    :raises PrefixResolutionError: as :func:`resolve_prefix`.
    """
    prefix = inline_prefix(admission)
    if prefix is not None:
        return prefix
    with _missing_chain_record():
        snapshots = await fetch_operation(source)(list(admission.staging_chain))
    return verify_staging_chain(admission, snapshots)
