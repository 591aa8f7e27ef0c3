"""Rebuilding the training row of a verified receipt (contract §8.1 steps 9-14), for :mod:`sink.trainer.verify`.

:func:`verify_lineage` checks every manifest row's parent link (step 9), :func:`chain_positions` finds the
terminal and its ancestry (step 10), and :func:`linearize_chain` lays out the chain's columns while checking
its masks, chain hashes and the terminal's cumulative hash (steps 11-13), then reads each chain call's sampling
provenance (step 14). Each failure of steps 9-13 raises a :class:`~sink.errors.RebuildError` whose ``code`` names
the check; step 14's a :class:`~sink.errors.ReceiptVerificationError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeAlias

from sink.contract.digest import (
    chain_hash_of_packed,
    compute_chain_hash,
    compute_extras_digest,
    hash_packed_token_ids,
    hash_token_ids,
)
from sink.contract.packed import PackedColumns, PackedSnapshot
from sink.contract.records import CallRecord, RolloutReceipt, StagedCallBaseSnapshot
from sink.contract.sampling import SAMPLING_EXTRAS_KEY, SamplingProvenance
from sink.errors import RebuildError, ReceiptVerificationError, SamplingProvenanceError
from sink.trainer.row import ExtrasCommitment, LinearizedRow, LinkSpan, RowColumns, WeightVersionSpan

__all__ = ("PackedCall", "Snapshot", "chain_positions", "linearize_chain", "verify_lineage")

#: What verification takes per manifest row.
Snapshot: TypeAlias = StagedCallBaseSnapshot | PackedSnapshot


class PackedCall(NamedTuple):
    """A snapshot's packed columns (proved at decode time) and its ids in digest form, hashed at step 8."""

    packed: PackedColumns
    ids_u64be: bytes


# --- verification steps ----------------------------------------------------------


def verify_lineage(manifest: Sequence[CallRecord], index_by_id: dict[str, int]) -> None:
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


def chain_positions(receipt: RolloutReceipt, index_by_id: dict[str, int]) -> list[int]:
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


def _mask_counts(masks: Sequence[float] | PackedColumns) -> tuple[int, int, int]:
    """``(carry, generated, index of the first 1.0 or -1)`` of a mask column, or of packed columns' codes;
    masks are exactly 0.0/1.0 here (step 8h)."""
    if isinstance(masks, PackedColumns):
        carry = masks.carry_length()
        if carry is not None:  # carry then generation: the counts follow from where it ends
            generated = masks.length - carry
            return carry, generated, carry if generated else -1
        codes = masks.mask_codes
        generated = codes.count(0x3F)
        return len(codes) - generated, generated, codes.find(0x3F)
    generated = masks.count(1.0)
    return len(masks) - generated, generated, masks.index(1.0) if generated else -1


def linearize_chain(
    receipt: RolloutReceipt,
    snapshots: Sequence[Snapshot],
    chain: list[int],
    packed_calls: Sequence[PackedCall | None],
) -> LinearizedRow:
    # Steps 11-13 while laying out the chain's columns. Where a call's packed
    # columns are known (decoded just now), hashes run over those bytes.
    manifest = receipt.manifest
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
            masks = snapshot.token_mask_delta
            carry, generated, first_one = _mask_counts(masks)
            length = len(masks)
        else:
            running_chain_hash = chain_hash_of_packed(running_chain_hash, packed_call.ids_u64be)
            carry, generated, first_one = _mask_counts(packed_call.packed)
            length = packed_call.packed.length
        if running_chain_hash != record.chain_hash:
            raise RebuildError(
                "chain_hash_mismatch", f"{call_id!r}: chain hash {record.chain_hash} != recomputed {running_chain_hash}"
            )
        # "Zeros then ones" holds iff the first 1.0 sits right after the zeros.
        if generated and first_one != carry:
            raise RebuildError("invalid_mask_order", f"{call_id!r}: masks are not carry zeros followed by ones")
        # Step 11's "at least one 1.0" per chain call. It also makes step 12 ("some mask in the row
        # is 1.0", empty_training_row) hold for every chain, so that defensive check has no branch.
        if not generated:
            raise RebuildError("empty_generation", f"{call_id!r}: the delta has no generated (mask 1.0) token")
        end = offset + length
        spans.append(WeightVersionSpan(call_id, offset, end, record.weight_version))
        links.append(LinkSpan(call_id, carry, generated))
        commitments.append(ExtrasCommitment(call_id, record.extras_digest_version, record.extras_digest))
        offset = end
    columns, row_hash = _row_columns([snapshots[position] for position in chain], chain_calls, offset)
    terminal = manifest[chain[-1]]
    if row_hash != terminal.cumulative_hash:
        raise RebuildError(
            "cumulative_hash_mismatch",
            f"terminal {terminal.model_call_id!r}: cumulative hash {terminal.cumulative_hash} != row hash {row_hash}",
        )
    return LinearizedRow(
        rollout_id=receipt.rollout_id,
        columns=columns,
        model_call_ids=tuple(link.model_call_id for link in links),
        prompt_len=links[0].carry_count,
        weight_versions=tuple(span.weight_version for span in spans),
        weight_version_spans=tuple(spans),
        link_spans=tuple(links),
        extras_commitments=tuple(commitments),
        sampling=tuple(_sampling(manifest[position], snapshots[position]) for position in chain),
    )


def _sampling(record: CallRecord, snapshot: Snapshot) -> SamplingProvenance | None:
    """Step 14: the call's sampling provenance from its extras, ``None`` when they hold none.

    A :class:`PackedSnapshot`'s extras were checked against its ``extras_digest`` when it was decoded (and step 8f
    proved that digest the manifest's); a model snapshot's are checked here, as they may have changed since it was
    validated.
    """
    extras = getattr(snapshot, "extras", None)
    if not isinstance(extras, Mapping) or SAMPLING_EXTRAS_KEY not in extras:
        return None
    call_id = record.model_call_id
    if not isinstance(snapshot, PackedSnapshot):
        try:
            recomputed = compute_extras_digest(extras)
        except (TypeError, ValueError) as exc:
            raise ReceiptVerificationError("corrupt_extras", f"{call_id!r}: cannot digest its extras: {exc}") from exc
        if recomputed != record.extras_digest:
            raise ReceiptVerificationError(
                "corrupt_extras", f"{call_id!r}: extras digest {recomputed} != recorded {record.extras_digest}"
            )
    try:
        return SamplingProvenance.from_extras(extras)
    except SamplingProvenanceError as exc:
        raise ReceiptVerificationError("invalid_sampling", f"{call_id!r}: {exc}") from exc


def _row_columns(
    chain_snapshots: Sequence[Snapshot], chain_calls: Sequence[PackedCall | None], length: int
) -> tuple[RowColumns, str]:
    """The row's columns and the hash of its ids (step 13's input).

    Packed, without a Python object per token, when every chain call has packed
    columns that hold its values exactly (float32 log-probabilities); else tuples
    of the snapshots' own values.
    """
    packed = [call for call in chain_calls if call is not None and call.packed.lp_f32_exact is True]
    if len(packed) == len(chain_calls):
        return RowColumns(parts=[call.packed for call in packed]), hash_packed_token_ids(
            [call.ids_u64be for call in packed], length
        )
    token_ids = tuple(itertools.chain.from_iterable(snapshot.token_ids_delta for snapshot in chain_snapshots))
    tuples = (
        token_ids,
        tuple(itertools.chain.from_iterable(snapshot.token_mask_delta for snapshot in chain_snapshots)),
        tuple(itertools.chain.from_iterable(snapshot.generation_log_probs_delta for snapshot in chain_snapshots)),
    )
    return RowColumns(tuples=tuples), hash_token_ids(token_ids)
