"""Collation: pulled rollouts in, one padded numpy training batch out (the trainer's step after ``pull``).

:func:`collate` turns the trainable :class:`~sink.trainer.pulled.PulledRollout` items
of a pull into a :class:`TrainingBatch`: ``[B, T]`` arrays right-padded to the
longest row (rounded up to ``pad_to_multiple_of``), plus per-row rewards,
weight versions and ids. Nothing is dropped silently: skipped rollouts and rows
longer than ``max_tokens`` are listed (``skipped``, ``overlong``), never
truncated, and :attr:`TrainingBatch.ack_ids` names every rollout to acknowledge
after the optimizer step.

Each row's columns are written straight from the stored bytes into the batch
arrays (:meth:`~sink.trainer.row.LinearizedRow.write_numpy`): one copy, no intermediate
array; padding is written only where a row ends.
Hand-off to PyTorch without a torch dependency here: ``torch.from_numpy(a)``
shares the array's memory (no copy), e.g.
``{name: torch.from_numpy(array) for name, array in batch.tensors().items()}``.

numpy is a default dependency of staging-sink; this module needs it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from sink.errors import BatchInputError
from sink.trainer.pulled import PulledRollout, SkippedRollout
from sink.trainer.row import LinearizedRow

__all__ = (
    "OverlongRow",
    "RowSelection",
    "SkippedRollout",
    "TrainingBatch",
    "chain_weights",
    "collate",
    "row_metadata",
    "select_rows",
)

_INT64_MAX = 2**63 - 1


class OverlongRow(NamedTuple):
    """A trainable rollout left out of a batch because its row is longer than ``max_tokens``."""

    rollout_id: str
    tokens: int
    max_tokens: int


class RowSelection(NamedTuple):
    """The trainable rows of a pull, in order, with their lengths; what was left out and why."""

    items: tuple[PulledRollout, ...]
    rows: tuple[LinearizedRow, ...]
    lengths: tuple[int, ...]
    overlong: tuple[OverlongRow, ...]
    skipped: tuple[SkippedRollout, ...]


def _check_int(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise BatchInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def select_rows(pulled: Sequence[PulledRollout], *, max_tokens: int | None = None) -> RowSelection:
    """Split *pulled* into trainable rows (with their numpy columns), overlong rows and skipped rollouts.

    :raises BatchInputError: an item is not a :class:`PulledRollout`, a rollout id appears twice, or
        *max_tokens* is not a positive int.
    """
    if max_tokens is not None:
        _check_int("max_tokens", max_tokens, 1)
    if isinstance(pulled, str | bytes) or not isinstance(pulled, Sequence):
        raise BatchInputError(f"expected a sequence of PulledRollout, got {type(pulled).__name__}")
    seen: set[str] = set()
    items: list[PulledRollout] = []
    rows: list[LinearizedRow] = []
    lengths: list[int] = []
    overlong: list[OverlongRow] = []
    skipped: list[SkippedRollout] = []
    for item in pulled:
        if not isinstance(item, PulledRollout):
            raise BatchInputError(f"expected PulledRollout items, got {type(item).__name__}")
        if item.rollout_id in seen:
            raise BatchInputError(f"rollout {item.rollout_id!r} appears twice")
        seen.add(item.rollout_id)
        if not item.trainable:
            skipped.append(item.skipped())
            continue
        for row in item.rows:  # one row per chain of a multi-chain rollout (contract §14.4)
            length = len(row.columns)
            if max_tokens is not None and length > max_tokens:
                overlong.append(OverlongRow(item.rollout_id, length, max_tokens))
                continue
            items.append(item)
            rows.append(row)
            lengths.append(length)
    return RowSelection(tuple(items), tuple(rows), tuple(lengths), tuple(overlong), tuple(skipped))


def row_metadata(
    items: Sequence[PulledRollout], rows: Sequence[LinearizedRow]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Per row: the reward (``NaN`` when the receipt has none; every chain of a rollout shares it),
    ``[oldest, newest]`` weight version of the row's own calls, and whether every call has sampling provenance."""
    rewards = np.array(
        [math.nan if item.receipt.reward is None else item.receipt.reward for item in items], dtype=np.float32
    )
    versions = np.zeros((len(items), 2), dtype=np.int64)
    for index, row in enumerate(rows):
        weights = row.weight_versions
        newest = max(weights)
        if newest > _INT64_MAX:  # the contract allows any u64; the column is int64 (what torch tensors take)
            raise BatchInputError(
                f"rollout {items[index].rollout_id!r}: weight version {newest} does not fit the batch's int64 "
                "weight_versions column (at most 2**63 - 1)"
            )
        versions[index] = (min(weights), newest)
    return rewards, versions, np.array([row.provenance_known for row in rows], dtype=np.bool_)


def chain_weights(
    rollout_ids: Sequence[str], weighting: Literal["shared", "split"] = "shared"
) -> npt.NDArray[np.float32]:
    """Per-row loss weights for the rows of a batch (its ``rollout_ids``), contract §14.4.

    Every chain of a rollout shares the rollout's reward, hence its GRPO advantage (group statistics are per
    rollout, :class:`~sink.trainer.groups.RolloutGroup`). ``shared``: each chain row weighs 1.0 (a rollout with
    more chains contributes more tokens); ``split``: each weighs ``1 / chains of its rollout in the batch``, so
    every rollout weighs the same whatever its number of chains.

    :raises BatchInputError: an unknown *weighting*.
    """
    if weighting not in ("shared", "split"):
        raise BatchInputError(f"weighting must be 'shared' or 'split', not {weighting!r}")
    if weighting == "shared":
        return np.ones(len(rollout_ids), dtype=np.float32)
    counts = Counter(rollout_ids)
    return np.array([1.0 / counts[rollout_id] for rollout_id in rollout_ids], dtype=np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class TrainingBatch:
    """One padded training batch (``B`` rows, ``T`` positions); arrays are fresh and owned by the caller.

    * ``input_ids`` ``[B, T]`` int64, padded with ``pad_token_id``;
    * ``attention_mask`` ``[B, T]`` bool, true on the row's tokens;
    * ``loss_mask`` ``[B, T]`` float32, the row's token mask (0.0 on carried prompt tokens and padding,
      1.0 on generated tokens);
    * ``generation_logprobs`` ``[B, T]`` float32, the behaviour log-probabilities (0.0 where the mask is 0);
    * ``policy_mask`` ``[B, T]`` bool, the rows' :meth:`~sink.trainer.row.LinearizedRow.policy_mask`: True on
      generated tokens sampled from the model's own distribution with its own log-prob (False on prompt tokens,
      padding, and tokens of constrained or biased calls); ``provenance_known`` ``[B]`` bool: every call of the
      row carries sampling provenance (without it, its generated tokens count as policy tokens);
    * ``input_lengths`` ``[B]`` int64; ``rewards`` ``[B]`` float32 (``NaN``: no reward);
    * ``weight_versions`` ``[B, 2]`` int64: oldest and newest weight version among the row's calls;
    * ``rollout_ids``, ``chain_indices`` (0 for a single chain) and ``group_ids`` (``None`` outside a group) per
      row: a multi-chain rollout gives one row per healthy chain (contract §14.4);
    * ``overlong`` / ``skipped``: rollouts pulled but not in the batch, with why.
    """

    input_ids: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.bool_]
    loss_mask: npt.NDArray[np.float32]
    generation_logprobs: npt.NDArray[np.float32]
    policy_mask: npt.NDArray[np.bool_]
    input_lengths: npt.NDArray[np.int64]
    rewards: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    provenance_known: npt.NDArray[np.bool_]
    rollout_ids: tuple[str, ...]
    group_ids: tuple[str | None, ...]
    pad_token_id: int
    overlong: tuple[OverlongRow, ...]
    skipped: tuple[SkippedRollout, ...]
    chain_indices: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """``B``: rows in the batch."""
        return len(self.rollout_ids)

    @property
    def ack_ids(self) -> tuple[str, ...]:
        """Every rollout this batch came from (rows, overlong, skipped): acknowledge them after the step."""
        ids = (*self.rollout_ids, *(o.rollout_id for o in self.overlong), *(s.rollout_id for s in self.skipped))
        return tuple(dict.fromkeys(ids))

    def tensors(self) -> dict[str, npt.NDArray[np.generic]]:
        """The per-token and per-row arrays by name, ready for ``torch.from_numpy`` (no copy)."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "loss_mask": self.loss_mask,
            "generation_logprobs": self.generation_logprobs,
            "policy_mask": self.policy_mask,
            "input_lengths": self.input_lengths,
            "rewards": self.rewards,
            "weight_versions": self.weight_versions,
            "provenance_known": self.provenance_known,
        }

    def __repr__(self) -> str:
        return (
            f"<TrainingBatch rows={self.size} positions={self.input_ids.shape[1]} "
            f"tokens={int(self.input_lengths.sum())} overlong={len(self.overlong)} skipped={len(self.skipped)}>"
        )


def collate(
    pulled: Sequence[PulledRollout],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    max_tokens: int | None = None,
) -> TrainingBatch:
    """One :class:`TrainingBatch` from the trainable rollouts of *pulled*, in order.

    ``T`` is the longest row rounded up to *pad_to_multiple_of*. Rows longer
    than *max_tokens* go to ``overlong`` (never truncated); rollouts that are
    not trainable go to ``skipped``.

    :raises BatchInputError: an option is out of range, an item is not a :class:`PulledRollout`, a rollout
        id appears twice, or a row's weight version does not fit the int64 ``weight_versions`` column (from
        ``2**63`` up; the contract allows any u64) (nothing was built).
    """
    _check_int("pad_token_id", pad_token_id, 0)
    _check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
    selection = select_rows(pulled, max_tokens=max_tokens)
    lengths = np.array(selection.lengths, dtype=np.int64)
    longest = int(lengths.max()) if lengths.size else 0
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    rows = len(selection.rows)
    input_ids = np.empty((rows, width), dtype=np.int64)
    loss_mask = np.empty((rows, width), dtype=np.float32)
    logprobs = np.empty((rows, width), dtype=np.float32)
    policy_mask = np.empty((rows, width), dtype=np.bool_)
    for index, row in enumerate(selection.rows):
        length = selection.lengths[index]
        # The one copy of each column, from the stored bytes into the batch; padding only past the row's end.
        row.write_numpy(input_ids[index, :length], loss_mask[index, :length], logprobs[index, :length])
        row.write_policy_mask(policy_mask[index, :length])
        input_ids[index, length:] = pad_token_id
        loss_mask[index, length:] = 0.0
        logprobs[index, length:] = 0.0
        policy_mask[index, length:] = False
    attention_mask = np.arange(width, dtype=np.int64)[None, :] < lengths[:, None]
    rewards, versions, known = row_metadata(selection.items, selection.rows)
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        generation_logprobs=logprobs,
        policy_mask=policy_mask,
        input_lengths=lengths,
        rewards=rewards,
        weight_versions=versions,
        provenance_known=known,
        rollout_ids=tuple(item.rollout_id for item in selection.items),
        group_ids=tuple(None if item.group is None else item.group.group_id for item in selection.items),
        pad_token_id=pad_token_id,
        overlong=selection.overlong,
        skipped=selection.skipped,
        chain_indices=tuple(row.chain_index for row in selection.rows),
    )
