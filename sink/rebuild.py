"""Trainer-side verification and linearization (contract §8).

:func:`verify_and_linearize` proves a token-free :class:`RolloutReceipt`
against the staged snapshots fetched for it (every digest, every lineage link,
the terminal's chain and cumulative hash) and concatenates the terminal call's
ancestry, root first, into one :class:`LinearizedRow`. Checks run in exactly
the order of contract §8.1; the first failure raises a
:class:`ReceiptVerificationError` (steps 2-8) or :class:`RebuildError`
(steps 9-13) whose ``code`` names the check. Verification reads no extras, has
no side effects, and is deterministic, so it is safe to retry.

numpy is optional (``pip install staging-sink[numpy]``): this module never
imports it at import time; only :meth:`LinearizedRow.as_numpy` does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ._columns import PackedColumns
from .digest import chain_hash_of_packed, compute_chain_hash, hash_packed_token_ids, hash_token_ids
from .errors import RebuildError, ReceiptVerificationError
from .records import CallRecord, RolloutReceipt, StagedCallBaseSnapshot

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = (
    "ExtrasCommitment",
    "LinearizedRow",
    "LinkSpan",
    "NumpyColumns",
    "WeightVersionSpan",
    "linearize",
    "verify_and_linearize",
)

# Step 8f: compared between snapshot and manifest row, first mismatch wins.
_IDENTITY_FIELDS: Final = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
# Step 8g: equal on snapshot, manifest row and receipt.
_VERSION_FIELDS: Final = ("schema_version", "digest_version", "extras_digest_version")
# Step 2: receipt versions and the code for each.
_RECEIPT_VERSIONS: Final = (
    ("schema_version", 2, "unsupported_schema"),
    ("digest_version", 2, "unsupported_digest"),
    ("extras_digest_version", 1, "unsupported_extras_digest"),
)
_MISSING: Final = object()


class WeightVersionSpan(NamedTuple):
    """Row positions ``[start, end)`` produced by one call under one weight version."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


class LinkSpan(NamedTuple):
    """How one chain call contributes to the row: carried prompt tokens, then generated ones."""

    model_call_id: str
    carry_count: int
    generated_count: int


class ExtrasCommitment(NamedTuple):
    """The extras digest a chain call committed to; verify fetched extras against it at point of use."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str


class _PackedCall(NamedTuple):
    """A snapshot's packed columns (proved at decode time) and its ids in digest form, hashed at step 8."""

    packed: PackedColumns
    ids_u64be: bytes


class NumpyColumns(NamedTuple):
    """The token columns of a :class:`LinearizedRow` as fresh numpy arrays."""

    token_ids: npt.NDArray[np.int64]
    token_mask: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, repr=False)
class LinearizedRow:
    """One verified training row: the terminal call's ancestry, root first.

    A frozen, slotted dataclass (not a pydantic model: it is built only by
    this module from verified data, so re-validation would be pure cost).
    Every field is a tuple, so the row is deeply immutable and hashable.
    Column values are exactly the objects the snapshots hold (a ``-0.0`` mask
    or log-probability keeps its sign). Equal inputs give equal rows.
    """

    rollout_id: str
    token_ids: tuple[int, ...]
    token_mask: tuple[float, ...]
    logprobs: tuple[float, ...]
    model_call_ids: tuple[str, ...]
    prompt_len: int
    weight_versions: tuple[int, ...]
    weight_version_spans: tuple[WeightVersionSpan, ...]
    link_spans: tuple[LinkSpan, ...]
    extras_commitments: tuple[ExtrasCommitment, ...]
    # Packed column bytes of the chain calls, when verification had them: as_numpy
    # then reads bytes instead of Python objects. Not part of the row's value.
    _packed_columns: tuple[PackedColumns, ...] | None = field(default=None, compare=False, hash=False)

    @property
    def call_ids(self) -> tuple[str, ...]:
        """Alias of :attr:`model_call_ids` (root to terminal)."""
        return self.model_call_ids

    def as_numpy(self) -> NumpyColumns:
        """Return ``(token_ids int64, token_mask float32, logprobs float32)`` as new arrays.

        The arrays are fresh on every call, so callers may mutate them.
        Float32 keeps the sign of ``-0.0`` and is exactly what the digests cover.

        :raises ImportError: numpy is not installed (``pip install staging-sink[numpy]``).
        :raises OverflowError: a token id does not fit in int64.
        """
        if self._packed_columns is not None:
            return _packed_to_numpy(self._packed_columns)
        return _columns_to_numpy(self.token_ids, self.token_mask, self.logprobs)

    def __repr__(self) -> str:
        # The columns can hold tens of thousands of tokens; keep logs readable.
        return (
            f"LinearizedRow(rollout_id={self.rollout_id!r}, tokens={len(self.token_ids)}, "
            f"prompt_len={self.prompt_len}, model_call_ids={self.model_call_ids!r}, "
            f"weight_versions={self.weight_versions!r})"
        )


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise ImportError(
            "LinearizedRow.as_numpy needs numpy, an optional extra: pip install 'staging-sink[numpy]'"
        ) from exc
    return numpy


def _packed_to_numpy(parts: Sequence[PackedColumns]) -> NumpyColumns:
    """Columns straight from packed bytes: no per-token Python object is touched."""
    np = _import_numpy()
    ids = np.concatenate([np.frombuffer(p.ids_le, dtype="<u4" if p.ids_width == 4 else "<u8") for p in parts])
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 1 << 63:
        raise OverflowError("a token id does not fit in int64")
    mask_table = np.zeros(256, dtype=np.float32)
    mask_table[0x80] = -0.0
    mask_table[0x3F] = 1.0
    codes = np.frombuffer(b"".join(p.mask_codes for p in parts), dtype=np.uint8)
    logprobs = np.frombuffer(b"".join(p.lp_f32be for p in parts), dtype=">f4")
    return NumpyColumns(ids.astype(np.int64), mask_table[codes], logprobs.astype(np.float32))


def _columns_to_numpy(token_ids: Sequence[int], token_mask: Sequence[float], logprobs: Sequence[float]) -> NumpyColumns:
    """Columns from the Python sequences (one C-level pass per column)."""
    np = _import_numpy()
    return NumpyColumns(
        np.array(token_ids, dtype=np.int64),
        np.array(token_mask, dtype=np.float32),
        np.array(logprobs, dtype=np.float32),
    )


# --- verification steps ----------------------------------------------------------


def _fail(code: str, detail: str) -> ReceiptVerificationError:
    return ReceiptVerificationError(code, detail)


def _check_argument_types(receipt: object, snapshots: object) -> None:
    # Step 1, plus the type of the snapshots argument (a programming error,
    # reported before anything about the receipt's state).
    if not isinstance(receipt, RolloutReceipt):
        raise TypeError(f"receipt must be a RolloutReceipt, got {type(receipt).__name__}")
    if not isinstance(snapshots, Sequence) or isinstance(snapshots, (str, bytes, bytearray)):
        raise TypeError(f"snapshots must be a sequence of StagedCallBaseSnapshot, got {type(snapshots).__name__}")


def _check_receipt_state(receipt: RolloutReceipt) -> None:
    # Steps 2-5.
    for name, expected, code in _RECEIPT_VERSIONS:
        value = getattr(receipt, name, _MISSING)
        if type(value) is not int or value != expected:
            raise _fail(code, f"receipt {name} is {value!r}, only {expected} is supported")
    if receipt.failure_reason is not None:
        raise _fail("rollout_failed", f"rollout {receipt.rollout_id!r} failed: {receipt.failure_reason}")
    if receipt.capture_poisoned:
        raise _fail("capture_poisoned", f"rollout {receipt.rollout_id!r} is capture-poisoned")
    if not receipt.manifest:
        raise _fail("empty_manifest", f"rollout {receipt.rollout_id!r} has an empty manifest")


def _index_manifest(manifest: Sequence[CallRecord]) -> dict[str, int]:
    # Step 6: one pass; per row the id is checked before the key.
    index_by_id: dict[str, int] = {}
    seen_keys: set[str] = set()
    for position, record in enumerate(manifest):
        if not isinstance(record, CallRecord):
            raise TypeError(f"manifest row {position} is a {type(record).__name__}, not a CallRecord")
        if record.model_call_id in index_by_id:
            raise _fail("duplicate_manifest_row", f"model_call_id {record.model_call_id!r} appears twice")
        if record.staging_key in seen_keys:
            raise _fail("duplicate_staging_key", f"staging key {record.staging_key!r} appears twice")
        index_by_id[record.model_call_id] = position
        seen_keys.add(record.staging_key)
    return index_by_id


def _verify_snapshot(
    position: int,
    snapshot: object,
    record: CallRecord,
    receipt: RolloutReceipt,
    index_by_id: dict[str, int],
    seen_ids: set[object],
    packed: PackedColumns | None,
) -> _PackedCall | None:
    # Steps 8a-8h for one manifest position. With packed columns, returns them
    # with the ids' digest form, which the chain and row hashes reuse.
    if not isinstance(snapshot, StagedCallBaseSnapshot):
        raise TypeError(f"snapshot {position} is a {type(snapshot).__name__}, not a StagedCallBaseSnapshot")
    call_id = getattr(snapshot, "model_call_id", _MISSING)
    where = f"position {position} ({record.model_call_id!r})"
    if call_id in seen_ids:
        raise _fail("duplicate_snapshot", f"{where}: snapshot {call_id!r} was already supplied")
    seen_ids.add(call_id)
    if call_id not in index_by_id:
        raise _fail("snapshot_identity_mismatch", f"{where}: snapshot {call_id!r} is not in the manifest")
    if call_id != record.model_call_id:
        raise _fail("snapshot_order_mismatch", f"{where}: got snapshot {call_id!r} out of manifest order")
    owner = record.capture_key or receipt.rollout_id
    staged_owner = getattr(snapshot, "rollout_id", _MISSING)
    if staged_owner != owner:
        raise _fail("wrong_rollout", f"{where}: snapshot staged under {staged_owner!r}, expected {owner!r}")
    for name in _IDENTITY_FIELDS:
        staged, recorded = getattr(snapshot, name, _MISSING), getattr(record, name)
        if staged != recorded:
            raise _fail(f"wrong_{name}", f"{where}: snapshot {name} {staged!r} != manifest {recorded!r}")
    for name in _VERSION_FIELDS:
        values = (getattr(snapshot, name, _MISSING), getattr(record, name), getattr(receipt, name))
        if not values[0] == values[1] == values[2]:
            raise _fail(f"wrong_{name}", f"{where}: {name} differs (snapshot, manifest, receipt) = {values!r}")
    packed_call = None
    try:
        # With packed columns proved at decode time the digest is hashed from
        # them; the result is the same digest, only the packing is skipped.
        recomputed = None
        if packed is not None:
            forms = packed.digest_forms()
            packed_call = _PackedCall(packed, b"".join(forms[0]))
            recomputed = snapshot._packed_digest(forms)
        recomputed = recomputed or snapshot.recompute_digest()
    except Exception as exc:  # any failure to recompute is reported, typed, with its cause chained
        raise _fail("invalid_snapshot", f"{where}: cannot recompute the call digest: {exc}") from exc
    if recomputed != snapshot.digest:
        raise _fail("corrupt_digest", f"{where}: recorded digest {snapshot.digest} != recomputed {recomputed}")
    return packed_call


def _verify_lineage(manifest: Sequence[CallRecord], index_by_id: dict[str, int]) -> None:
    # Step 9, every row (side branches included), each row's checks in order.
    acyclic: set[str] = set()
    for record in manifest:
        parent_id = record.parent_call_id
        if parent_id is not None:
            parent_index = index_by_id.get(parent_id)
            if parent_index is None:
                raise RebuildError("missing_parent", f"{record.model_call_id!r} names absent parent {parent_id!r}")
            parent = manifest[parent_index]
            if parent.cum_len != record.prev_len:
                raise RebuildError(
                    "parent_length_mismatch",
                    f"{record.model_call_id!r} has prev_len {record.prev_len}, "
                    f"parent {parent_id!r} has cum_len {parent.cum_len}",
                )
        path: set[str] = set()
        node: CallRecord | None = record
        while node is not None and node.model_call_id not in acyclic:
            if node.model_call_id in path:
                raise RebuildError(
                    "lineage_cycle", f"walking the parents of {record.model_call_id!r} revisits {node.model_call_id!r}"
                )
            path.add(node.model_call_id)
            next_index = None if node.parent_call_id is None else index_by_id.get(node.parent_call_id)
            node = None if next_index is None else manifest[next_index]
        acyclic |= path


def _chain_positions(receipt: RolloutReceipt, index_by_id: dict[str, int]) -> list[int]:
    # Step 10, then the terminal's ancestry root first (step 9 proved it finite and complete).
    terminal_id = receipt.terminal_model_call_id
    terminal_index = None if terminal_id is None else index_by_id.get(terminal_id)
    if terminal_index is None:
        raise RebuildError("missing_terminal", f"terminal {terminal_id!r} is not a manifest row")
    manifest = receipt.manifest
    chain = [terminal_index]
    parent_id = manifest[terminal_index].parent_call_id
    while parent_id is not None:
        chain.append(index_by_id[parent_id])
        parent_id = manifest[chain[-1]].parent_call_id
    chain.reverse()
    return chain


def _mask_counts(masks: Sequence[float], packed: PackedColumns | None) -> tuple[int, int, int]:
    """``(carry, generated, index of the first 1.0 or -1)``; masks are exactly 0.0/1.0 here (step 8h)."""
    if packed is not None:
        codes = packed.mask_codes
        generated = codes.count(0x3F)
        return len(codes) - generated, generated, codes.find(0x3F)
    generated = masks.count(1.0)
    return len(masks) - generated, generated, masks.index(1.0) if generated else -1


def _linearize_chain(
    receipt: RolloutReceipt,
    snapshots: Sequence[StagedCallBaseSnapshot],
    chain: list[int],
    packed_calls: Sequence[_PackedCall | None],
) -> LinearizedRow:
    # Steps 11-13 while concatenating the chain's columns. Where a call's
    # packed columns are known (decoded just now), hashes run over those bytes.
    manifest = receipt.manifest
    ids_parts: list[list[int]] = []
    mask_parts: list[list[float]] = []
    logprob_parts: list[list[float]] = []
    spans: list[WeightVersionSpan] = []
    links: list[LinkSpan] = []
    commitments: list[ExtrasCommitment] = []
    running_chain_hash: str | None = None
    offset = 0
    chain_calls = [packed_calls[position] for position in chain]
    for position, packed_call in zip(chain, chain_calls, strict=True):
        record, snapshot = manifest[position], snapshots[position]
        call_id = record.model_call_id
        if packed_call is None:
            running_chain_hash = compute_chain_hash(running_chain_hash, snapshot.token_ids_delta)
        else:
            running_chain_hash = chain_hash_of_packed(running_chain_hash, packed_call.ids_u64be)
        if running_chain_hash != record.chain_hash:
            raise RebuildError(
                "chain_hash_mismatch", f"{call_id!r}: chain hash {record.chain_hash} != recomputed {running_chain_hash}"
            )
        masks = snapshot.token_mask_delta
        # "Zeros then ones" holds iff the first 1.0 sits right after the zeros.
        carry, generated, first_one = _mask_counts(masks, None if packed_call is None else packed_call.packed)
        if generated and first_one != carry:
            raise RebuildError("invalid_mask_order", f"{call_id!r}: masks are not carry zeros followed by ones")
        if not generated:
            raise RebuildError("empty_generation", f"{call_id!r}: the delta has no generated (mask 1.0) token")
        ids_parts.append(snapshot.token_ids_delta)
        mask_parts.append(masks)
        logprob_parts.append(snapshot.generation_log_probs_delta)
        end = offset + len(masks)
        spans.append(WeightVersionSpan(call_id, offset, end, record.weight_version))
        links.append(LinkSpan(call_id, carry, generated))
        commitments.append(ExtrasCommitment(call_id, record.extras_digest_version, record.extras_digest))
        offset = end
    if not any(link.generated_count for link in links):
        raise RebuildError("empty_training_row", f"rollout {receipt.rollout_id!r}: no mask in the row is 1.0")
    token_ids = tuple(itertools.chain.from_iterable(ids_parts))
    terminal = manifest[chain[-1]]
    # The row hash and as_numpy run over packed bytes only when every chain call has them.
    known = [packed_call for packed_call in chain_calls if packed_call is not None]
    all_packed = len(known) == len(chain_calls)
    row_hash = (
        hash_packed_token_ids([call.ids_u64be for call in known], offset) if all_packed else hash_token_ids(token_ids)
    )
    if row_hash != terminal.cumulative_hash:
        raise RebuildError(
            "cumulative_hash_mismatch",
            f"terminal {terminal.model_call_id!r}: cumulative hash {terminal.cumulative_hash} != row hash {row_hash}",
        )
    return LinearizedRow(
        rollout_id=receipt.rollout_id,
        token_ids=token_ids,
        token_mask=tuple(itertools.chain.from_iterable(mask_parts)),
        logprobs=tuple(itertools.chain.from_iterable(logprob_parts)),
        model_call_ids=tuple(link.model_call_id for link in links),
        prompt_len=links[0].carry_count,
        weight_versions=tuple(span.weight_version for span in spans),
        weight_version_spans=tuple(spans),
        link_spans=tuple(links),
        extras_commitments=tuple(commitments),
        _packed_columns=tuple(call.packed for call in known) if all_packed else None,
    )


# --- public entry points ---------------------------------------------------------


def verify_and_linearize(receipt: RolloutReceipt, snapshots: Sequence[StagedCallBaseSnapshot]) -> LinearizedRow:
    """Verify *receipt* against *snapshots* (in manifest order) and linearize its terminal chain.

    Runs every check of contract §8.1 in order. Side branches are verified
    (steps 8 and 9) but not linearized. Extras are never read; the row's
    ``extras_commitments`` let consumers verify extras at point of use.

    :raises TypeError: *receipt* is not a ``RolloutReceipt``, *snapshots* is
        not a sequence, or an element is not a ``StagedCallBaseSnapshot``.
    :raises ReceiptVerificationError: steps 2-8 fail (``.code`` names the check).
    :raises RebuildError: steps 9-13 fail (lineage, terminal, chain, masks, hashes).
    """
    return _verify_and_linearize(receipt, snapshots, use_cached_columns=False)


def _verify_and_linearize(
    receipt: RolloutReceipt, snapshots: Sequence[StagedCallBaseSnapshot], *, use_cached_columns: bool
) -> LinearizedRow:
    """:func:`verify_and_linearize`; with *use_cached_columns*, hash the packed columns a
    snapshot proved at decode time instead of re-packing its lists.

    Only the trainer reader sets it, for snapshots it decoded itself and never
    handed out: a record's cache cannot notice element assignment after
    validation, so callers holding arbitrary snapshots use the public function.
    """
    _check_argument_types(receipt, snapshots)
    _check_receipt_state(receipt)
    manifest = receipt.manifest
    index_by_id = _index_manifest(manifest)
    if len(snapshots) != len(manifest):
        raise _fail("row_count_mismatch", f"{len(snapshots)} snapshots for {len(manifest)} manifest rows")
    seen_ids: set[object] = set()
    packed_calls: list[_PackedCall | None] = []
    for position, (snapshot, record) in enumerate(zip(snapshots, manifest, strict=True)):
        packed = _cached_columns(snapshot) if use_cached_columns else None
        packed_calls.append(_verify_snapshot(position, snapshot, record, receipt, index_by_id, seen_ids, packed))
    _verify_lineage(manifest, index_by_id)
    chain = _chain_positions(receipt, index_by_id)
    return _linearize_chain(receipt, snapshots, chain, packed_calls)


def _cached_columns(snapshot: object) -> PackedColumns | None:
    getter = getattr(snapshot, "_cached_packed_columns", None)
    return getter() if getter is not None else None


def linearize(
    rollout_id: str,
    snapshots: Sequence[StagedCallBaseSnapshot],
    manifest: Sequence[CallRecord],
    *,
    terminal_hint: str | None = None,
) -> LinearizedRow:
    """Linearize a manifest with a declared terminal (contract §8.4).

    Builds an unpoisoned receipt with ``terminal_selection="declared"`` and
    calls :func:`verify_and_linearize`. The receipt is assembled without
    pydantic validation on purpose: verification re-checks everything the
    receipt validators would (empty manifest, duplicate ids, absent terminal)
    and reports each with its precise §8.1 code instead of a ``ValidationError``.

    :raises RebuildError: ``missing_terminal`` when *terminal_hint* is ``None``
        (or names no manifest row).
    :raises TypeError: an argument has the wrong type.
    :raises ValueError: *rollout_id* is empty.
    :raises ReceiptVerificationError: any other check of §8.1 fails.
    """
    if terminal_hint is None:
        raise RebuildError("missing_terminal", f"no terminal hint for rollout {rollout_id!r}")
    if type(rollout_id) is not str or type(terminal_hint) is not str:
        raise TypeError("rollout_id and terminal_hint must be str")
    if not rollout_id:
        raise ValueError("rollout_id must be non-empty")
    if not isinstance(manifest, Sequence) or isinstance(manifest, (str, bytes, bytearray)):
        raise TypeError(f"manifest must be a sequence of CallRecord, got {type(manifest).__name__}")
    receipt = RolloutReceipt.model_construct(
        rollout_id=rollout_id,
        manifest=list(manifest),
        terminal_model_call_id=terminal_hint,
        terminal_selection="declared",
    )
    return verify_and_linearize(receipt, snapshots)
