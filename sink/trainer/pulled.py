"""One pulled rollout: a receipt turned into a verified training row, or a skip with its reason (contract §8).

:func:`fetch_and_verify` is the per-rollout work of
:meth:`sink.trainer.reader.rollout_reader.RolloutReader.pull`: fetch the staged records the manifest
names, verify them against the receipt and linearize them. Nothing is dropped
silently: every failure becomes a skipped :class:`PulledRollout` with a code.

A multi-chain rollout (its receipts entry carries a chain record, contract §14) is verified chain by chain,
each chain against its own tree's rows exactly as one rollout is (every digest and link), and delivers one
row per healthy chain in :attr:`PulledRollout.rows`; a poisoned chain is a :class:`ChainSkip` beside them.
A GRPO group of pulled rollouts is a :class:`~sink.trainer.groups.RolloutGroup`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from pydantic import ValidationError

from sink.contract.chains import ChainEntry, RolloutChains
from sink.contract.packed import PackedSnapshot
from sink.contract.records import RolloutReceipt
from sink.contract.skip_codes import SkipCode
from sink.errors import CodecError, ReceiptVerificationError
from sink.keys import validate_rollout_id
from sink.rollout.chains import CHAINS_FIELD
from sink.rollout.done_event import GroupTag
from sink.rollout.group_entry import GroupEntry
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.verify import LinearizedRow, verify_decoded_and_linearize

__all__ = (
    "ChainSkip",
    "PulledRollout",
    "SkippedRollout",
    "chain_receipt",
    "fetch_and_verify",
    "parse_receipt_chains",
    "parse_receipt_entry",
    "with_group",
)


class SkippedRollout(NamedTuple):
    """A pulled rollout that is not trainable (or was skipped by the reader), with its skip code and reason."""

    rollout_id: str
    skip_code: str
    skip_reason: str


class ChainSkip(NamedTuple):
    """One chain of a multi-chain rollout that is not trained, with its skip code and reason."""

    chain_index: int
    root_call_id: str
    skip_code: str
    skip_reason: str


@dataclass(frozen=True, slots=True)
class PulledRollout:
    """One pulled rollout: trainable (``rows`` non-empty) or skipped (``skip_code`` and ``skip_reason`` set).

    ``row``: a single-chain rollout's row. A multi-chain rollout (``chains`` set) has ``row=None`` and its
    rows in ``chain_rows`` (one per healthy chain, each with its ``chain_index``) and its poisoned chains in
    ``chain_skips``; when no chain trains, ``skip_code`` is the first chain's. ``rows`` covers both cases.
    ``group``: the GRPO group given to :func:`~sink.rollout.done_event.finished`, or ``None``; ``group_entry``: how
    a grouped rollout was published (the entry of its whole group, or alone as a late member), or ``None``.
    """

    receipt: RolloutReceipt
    row: LinearizedRow | None = None
    skip_code: str | None = None
    skip_reason: str | None = None
    group: GroupTag | None = None
    chains: RolloutChains | None = None
    chain_rows: tuple[LinearizedRow, ...] = ()
    chain_skips: tuple[ChainSkip, ...] = ()
    group_entry: GroupEntry | None = None

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id

    @property
    def rows(self) -> tuple[LinearizedRow, ...]:
        """Every verified row of the rollout: ``(row,)``, or the chain rows of a multi-chain rollout."""
        if self.chains is not None:
            return self.chain_rows
        return () if self.row is None else (self.row,)

    @property
    def trainable(self) -> bool:
        return bool(self.rows)

    def skipped(self) -> SkippedRollout:
        """This rollout as a :class:`SkippedRollout` (``skip_code`` ``""`` if it is trainable)."""
        return SkippedRollout(self.rollout_id, self.skip_code or "", self.skip_reason or "")


def parse_receipt_entry(fields: Mapping[str, str]) -> RolloutReceipt:
    """The receipt of a ``ns:receipts:<k>`` entry.

    :raises ValueError: a field is missing, the receipt is invalid, or it names another rollout.
    """
    try:
        receipt = RolloutReceipt.model_validate_json(fields["receipt"])
        rollout_id = fields["rollout_id"]
    except KeyError as exc:
        raise ValueError(f"missing field {exc}") from exc
    if receipt.rollout_id != validate_rollout_id(rollout_id):
        raise ValueError("rollout_id field does not match the receipt")
    return receipt


def parse_receipt_chains(fields: Mapping[str, str], receipt: RolloutReceipt) -> RolloutChains | None:
    """The chain record a ``ns:receipts:<k>`` entry carries beside *receipt*, or ``None`` (single chain).

    :raises ValueError: the record is malformed, names another rollout, or a call outside the receipt's manifest.
    """
    text = fields.get(CHAINS_FIELD)
    if text is None:
        return None
    try:
        chains = RolloutChains.model_validate_json(text)
    except ValidationError as exc:
        raise ValueError(f"malformed chain record: {exc}") from exc
    if chains.rollout_id != receipt.rollout_id:
        raise ValueError("the chain record names another rollout")
    known = {row.model_call_id for row in receipt.manifest}
    if any(not set(chain.tree_call_ids) <= known for chain in chains.chains):
        raise ValueError("the chain record names a call outside the receipt's manifest")
    return chains


def with_group(pulled: PulledRollout, group: GroupTag | None, entry: GroupEntry | None = None) -> PulledRollout:
    """*pulled* carrying *group* and the *entry* it was delivered in."""
    return pulled if group is None and entry is None else replace(pulled, group=group, group_entry=entry)


def _skip(receipt: RolloutReceipt, code: str, reason: str) -> PulledRollout:
    return PulledRollout(receipt=receipt, skip_code=code, skip_reason=reason)


async def fetch_and_verify(
    source: AsyncRedisStagingSource,
    receipt: RolloutReceipt,
    chains: RolloutChains | None = None,
    *,
    whole_rollout: bool = False,
) -> PulledRollout:
    """Fetch *receipt*'s staged records from *source*, verify and linearize them; a failure is a skip.

    With *chains* (contract §14.4), one row per healthy chain; *whole_rollout*: one poisoned chain skips the
    whole rollout.

    :raises StagingConnectionError: the server could not be reached.
    """
    if chains is not None:
        return await _fetch_chains(source, receipt, chains, whole_rollout)
    if receipt.failure_reason is not None:
        return _skip(receipt, SkipCode.ROLLOUT_FAILED, receipt.failure_reason)
    if receipt.capture_poisoned:
        return _skip(
            receipt, SkipCode.CAPTURE_POISONED, receipt.terminal_attribution_reason or SkipCode.CAPTURE_POISONED
        )
    try:
        # One fetch per rollout: one MGET per slot, and a rollout lives in one slot.
        snapshots = await source.fetch_packed([row.staging_key for row in receipt.manifest])
    except KeyError as exc:
        return _skip(receipt, SkipCode.MISSING_RECORD, str(exc.args[0]) if exc.args else str(exc))
    except CodecError as exc:
        return _skip(receipt, SkipCode.CORRUPT_RECORD, str(exc))
    try:
        # Decoded just now, packed, and not shared: verified at decode (same
        # checks, same digests), and the row keeps their bytes.
        row = verify_decoded_and_linearize(receipt, snapshots)
    except ReceiptVerificationError as exc:
        return _skip(receipt, exc.code, exc.detail)
    return PulledRollout(receipt=receipt, row=row)


def chain_receipt(receipt: RolloutReceipt, chain: ChainEntry) -> RolloutReceipt:
    """The unpoisoned receipt one healthy chain is verified against: its tree's rows, its terminal."""
    tree = set(chain.tree_call_ids)
    return RolloutReceipt(
        rollout_id=receipt.rollout_id,
        reward=receipt.reward,
        terminal_model_call_id=chain.terminal_call_id,
        manifest=[row for row in receipt.manifest if row.model_call_id in tree],
        terminal_selection="heuristic" if chain.selection == "leaf" else chain.selection,
        terminal_attribution_reason=receipt.terminal_attribution_reason,
    )


async def _fetch_tree(
    source: AsyncRedisStagingSource, receipt: RolloutReceipt, tree: set[str]
) -> dict[str, PackedSnapshot] | tuple[str, str]:
    """The snapshots of *tree*'s rows by call id, or ``(skip code, reason)``."""
    rows = [row for row in receipt.manifest if row.model_call_id in tree]
    try:
        snapshots = await source.fetch_packed([row.staging_key for row in rows])
    except KeyError as exc:
        return SkipCode.MISSING_RECORD, str(exc.args[0]) if exc.args else str(exc)
    except CodecError as exc:
        return SkipCode.CORRUPT_RECORD, str(exc)
    return {row.model_call_id: snapshot for row, snapshot in zip(rows, snapshots, strict=True)}


def _verify_chain(
    receipt: RolloutReceipt, chain: ChainEntry, snapshots: Mapping[str, PackedSnapshot]
) -> LinearizedRow | ChainSkip:
    try:
        row = verify_decoded_and_linearize(
            chain_receipt(receipt, chain), [snapshots[call_id] for call_id in chain.tree_call_ids]
        )
    except ReceiptVerificationError as exc:
        return ChainSkip(chain.index, chain.root_call_id, exc.code, exc.detail)
    return replace(row, chain_index=chain.index)


async def _fetch_chains(
    source: AsyncRedisStagingSource, receipt: RolloutReceipt, chains: RolloutChains, whole_rollout: bool
) -> PulledRollout:
    if chains.failure_reason is not None:
        return PulledRollout(
            receipt, skip_code=SkipCode.ROLLOUT_FAILED, skip_reason=chains.failure_reason, chains=chains
        )
    healthy = [chain for chain in chains.chains if chain.failure_reason is None]
    # One fetch for the whole rollout (one MGET: a rollout lives in one slot); tree by tree only when it fails,
    # so a missing or corrupt record poisons only the chains whose tree holds it.
    fetched = await _fetch_tree(source, receipt, {call for chain in healthy for call in chain.tree_call_ids})
    rows: list[LinearizedRow] = []
    skips: list[ChainSkip] = []
    for chain in chains.chains:
        if chain.failure_reason is not None:
            skips.append(ChainSkip(chain.index, chain.root_call_id, SkipCode.ROLLOUT_FAILED, chain.failure_reason))
            continue
        snapshots = (
            fetched if isinstance(fetched, dict) else await _fetch_tree(source, receipt, set(chain.tree_call_ids))
        )
        if isinstance(snapshots, tuple):
            skips.append(ChainSkip(chain.index, chain.root_call_id, *snapshots))
            continue
        result = _verify_chain(receipt, chain, snapshots)
        if isinstance(result, ChainSkip):
            skips.append(result)
        else:
            rows.append(result)
    skips.sort(key=lambda skip: skip.chain_index)
    if skips and (whole_rollout or not rows):
        first = skips[0]
        reason = f"chain {first.chain_index} (root {first.root_call_id}): {first.skip_reason}"
        return PulledRollout(
            receipt, skip_code=first.skip_code, skip_reason=reason, chains=chains, chain_skips=tuple(skips)
        )
    return PulledRollout(receipt, chains=chains, chain_rows=tuple(rows), chain_skips=tuple(skips))
