"""Sequence packing: pulled rollouts into fixed-width bins for variable-length attention kernels.

:func:`pack` places every trainable row into bins of ``max_tokens`` positions,
first-fit decreasing (longest row first, into the first bin with room), and
lays each bin out the way varlen attention kernels take it: the rows one after
another, with per-token ``position_ids`` restarting at 0 for each row,
``segment_ids`` naming the row (its index in ``rollout_ids``; ``-1`` on
padding) and, per bin, ``cu_seqlens`` (int32 cumulative row lengths, starting
at 0). Rows longer than ``max_tokens`` are reported in ``overlong``, never
truncated or split; skipped rollouts in ``skipped``.

Per-row values (``rewards``, ``weight_versions``, an advantage) reach tokens
by ``values[segment_ids]`` where ``segment_ids >= 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sink.trainer.batch import OverlongRow, SkippedRollout, _check_int, row_metadata, select_rows
from sink.trainer.pulled import PulledRollout

__all__ = ("PackedBatch", "first_fit_decreasing", "pack")


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of row indices: each row, longest first (ties by index), goes into the first bin with room.

    Every length must be ``<= capacity``; rows keep their longest-first order inside a bin.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    bins: list[list[int]] = []
    free: list[int] = []
    for index in order:
        length = lengths[index]
        for slot, room in enumerate(free):
            if room >= length:
                bins[slot].append(index)
                free[slot] = room - length
                break
        else:
            bins.append([index])
            free.append(capacity - length)
    return bins


@dataclass(frozen=True, slots=True, eq=False)
class PackedBatch:
    """Rows packed into ``N`` bins of ``max_tokens`` positions; arrays are fresh and owned by the caller.

    * ``input_ids`` ``[N, max_tokens]`` int64 (padding: ``pad_token_id``); ``position_ids`` ``[N, max_tokens]``
      int64 (0 on padding); ``segment_ids`` ``[N, max_tokens]`` int64 (row index, ``-1`` on padding);
    * ``loss_mask``, ``generation_logprobs`` ``[N, max_tokens]`` float32 (0.0 on padding); ``policy_mask``
      ``[N, max_tokens]`` bool (False on padding), as :class:`~sink.trainer.batch.TrainingBatch`'s;
    * ``cu_seqlens``: per bin, int32 ``[rows_in_bin + 1]``; ``bins``: per bin, the row indices in order;
    * per row (index = segment id): ``rollout_ids``, ``group_ids``, ``input_lengths``, ``rewards``
      (``NaN``: none), ``weight_versions`` ``[B, 2]`` (oldest, newest), ``provenance_known`` ``[B]`` bool.
    """

    input_ids: npt.NDArray[np.int64]
    position_ids: npt.NDArray[np.int64]
    segment_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.float32]
    generation_logprobs: npt.NDArray[np.float32]
    policy_mask: npt.NDArray[np.bool_]
    cu_seqlens: tuple[npt.NDArray[np.int32], ...]
    bins: tuple[tuple[int, ...], ...]
    input_lengths: npt.NDArray[np.int64]
    rewards: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    provenance_known: npt.NDArray[np.bool_]
    rollout_ids: tuple[str, ...]
    group_ids: tuple[str | None, ...]
    max_tokens: int
    pad_token_id: int
    overlong: tuple[OverlongRow, ...]
    skipped: tuple[SkippedRollout, ...]
    chain_indices: tuple[int, ...] = ()
    """Per row: its chain of a multi-chain rollout (contract §14.4), 0 for a single chain."""

    @property
    def ack_ids(self) -> tuple[str, ...]:
        """Every rollout this batch came from (rows, overlong, skipped): acknowledge them after the step."""
        ids = (*self.rollout_ids, *(o.rollout_id for o in self.overlong), *(s.rollout_id for s in self.skipped))
        return tuple(dict.fromkeys(ids))

    @property
    def fill(self) -> float:
        """Fraction of positions holding a token (1.0: no padding)."""
        positions = self.input_ids.size
        return float(self.input_lengths.sum()) / positions if positions else 1.0

    def __repr__(self) -> str:
        return (
            f"<PackedBatch rows={len(self.rollout_ids)} bins={len(self.bins)} max_tokens={self.max_tokens} "
            f"fill={self.fill:.3f} overlong={len(self.overlong)} skipped={len(self.skipped)}>"
        )


def pack(pulled: Sequence[PulledRollout], *, max_tokens: int, pad_token_id: int = 0) -> PackedBatch:
    """Pack the trainable rollouts of *pulled* into bins of *max_tokens* positions (first-fit decreasing).

    :raises BatchInputError: an option is out of range, an item is not a :class:`PulledRollout`, a rollout
        id appears twice, or a row's weight version does not fit the int64 ``weight_versions`` column (from
        ``2**63`` up; the contract allows any u64) (nothing was built).
    """
    _check_int("max_tokens", max_tokens, 1)
    _check_int("pad_token_id", pad_token_id, 0)
    selection = select_rows(pulled, max_tokens=max_tokens)
    lengths = list(selection.lengths)
    bins = first_fit_decreasing(lengths, max_tokens)
    count = len(bins)
    input_ids = np.empty((count, max_tokens), dtype=np.int64)
    position_ids = np.empty((count, max_tokens), dtype=np.int64)
    segment_ids = np.empty((count, max_tokens), dtype=np.int64)
    loss_mask = np.empty((count, max_tokens), dtype=np.float32)
    logprobs = np.empty((count, max_tokens), dtype=np.float32)
    policy_mask = np.empty((count, max_tokens), dtype=np.bool_)
    ramp = np.arange(max_tokens, dtype=np.int64)
    cu_seqlens: list[npt.NDArray[np.int32]] = []
    for slot, members in enumerate(bins):
        offsets = np.zeros(len(members) + 1, dtype=np.int32)
        start = 0
        for position, index in enumerate(members):
            end = start + lengths[index]
            # The one copy of each column, from the stored bytes into its bin.
            row = selection.rows[index]
            row.write_numpy(input_ids[slot, start:end], loss_mask[slot, start:end], logprobs[slot, start:end])
            row.write_policy_mask(policy_mask[slot, start:end])
            position_ids[slot, start:end] = ramp[: end - start]
            segment_ids[slot, start:end] = index
            offsets[position + 1] = end
            start = end
        input_ids[slot, start:] = pad_token_id
        loss_mask[slot, start:] = 0.0
        logprobs[slot, start:] = 0.0
        policy_mask[slot, start:] = False
        position_ids[slot, start:] = 0
        segment_ids[slot, start:] = -1
        cu_seqlens.append(offsets)
    rewards, versions, known = row_metadata(selection.items, selection.rows)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        segment_ids=segment_ids,
        loss_mask=loss_mask,
        generation_logprobs=logprobs,
        policy_mask=policy_mask,
        cu_seqlens=tuple(cu_seqlens),
        bins=tuple(tuple(members) for members in bins),
        input_lengths=np.array(lengths, dtype=np.int64),
        rewards=rewards,
        weight_versions=versions,
        provenance_known=known,
        rollout_ids=tuple(item.rollout_id for item in selection.items),
        group_ids=tuple(None if item.group is None else item.group.group_id for item in selection.items),
        max_tokens=max_tokens,
        pad_token_id=pad_token_id,
        overlong=selection.overlong,
        skipped=selection.skipped,
        chain_indices=tuple(row.chain_index for row in selection.rows),
    )
