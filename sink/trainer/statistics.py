"""The trainer side's figures: the readers' counters (:meth:`~sink.trainer.reader.rollout_reader.RolloutReader.statistics`,
:meth:`~sink.trainer.groups.GroupReader.statistics`) and the training/inference mismatch report of a row
(:func:`mismatch_report`).

numpy is a default dependency, imported lazily: only :func:`mismatch_report` imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from sink.errors import BatchInputError
from sink.trainer.row import LinearizedRow

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ("MismatchReport", "MismatchStats", "ReaderStatistics", "mismatch_report")


class ReaderStatistics(NamedTuple):
    """Counters of one :class:`~sink.trainer.reader.rollout_reader.RolloutReader` since it was opened; ``held``: pulled, not acked.

    ``skipped_by_code``: skipped rollouts per skip code (e.g. ``stale_weights``, ``rollout_failed``), sorted.
    """

    pulled: int
    trainable: int
    skipped: int
    duplicates_dropped: int
    acked: int
    reclaimed: int
    dead_lettered: int
    lost: int
    held: int
    skipped_by_code: tuple[tuple[str, int], ...] = ()
    double_deliveries: int = 0
    """Rollouts this reader claimed from an entry delivered before (another rank, or this one before a
    restart, may have trained them too)."""


@dataclass(frozen=True, slots=True)
class MismatchStats:
    """The trainer's log-probs against the staged (inference) ones over one set of a row's generated tokens.

    With ``r = logp_trainer - logp_inference`` per token: ``max_abs_diff`` and ``mean_abs_diff`` of ``|r|``,
    ``fraction_over`` the fraction with ``|r| > threshold``, and the means of the KL estimators of
    Schulman's "Approximating KL divergence" (the tokens were sampled by inference, so they estimate
    ``KL(inference || trainer)``): ``kl_k1`` of ``-r``, ``kl_k2`` of ``r**2 / 2``, ``kl_k3`` of
    ``(exp(r) - 1) - r``. Every figure is ``NaN`` when ``tokens`` is 0.
    """

    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    fraction_over: float
    kl_k1: float
    kl_k2: float
    kl_k3: float


@dataclass(frozen=True, slots=True, eq=False)
class MismatchReport:
    """:func:`mismatch_report`'s result for one row.

    ``difference``: float64, aligned with the row's tokens, ``r`` on generated tokens and 0.0 on prompt tokens;
    ``policy_mask``: the row's :meth:`~sink.trainer.row.LinearizedRow.policy_mask`; ``policy``: the figures over
    the policy tokens; ``flagged``: over the generated tokens the mask leaves out (grammar-constrained, biased, or
    within ``min_tokens``: their staged log-prob is not the model's, so they are kept apart); ``threshold``: the
    one ``fraction_over`` used; ``provenance_known``: every call of the row had sampling provenance (without it a
    call's tokens count as policy tokens).
    """

    difference: npt.NDArray[np.float64]
    policy_mask: npt.NDArray[np.bool_]
    policy: MismatchStats
    flagged: MismatchStats
    threshold: float
    provenance_known: bool


def mismatch_report(row: LinearizedRow, trainer_logprobs: object, *, threshold: float = 0.01) -> MismatchReport:
    """How far the trainer's own log-probs for *row* are from the staged (inference) ones.

    *trainer_logprobs*: one value per token of the row (a 1-D array or sequence, e.g. a CPU tensor), the
    trainer's log-prob of each token given the tokens before it; only the generated positions are read (they
    must be finite). Policy tokens and flagged tokens are reported separately (:class:`MismatchReport`).

    :raises BatchInputError: *row* is not a :class:`~sink.trainer.row.LinearizedRow`, *trainer_logprobs* is not
        numeric, has another length than the row or a non-finite value at a generated position, or *threshold*
        is not a finite number >= 0.
    """
    import numpy as np

    if not isinstance(row, LinearizedRow):
        raise BatchInputError(f"mismatch_report takes a LinearizedRow, got {type(row).__name__}")
    if type(threshold) not in (int, float) or not math.isfinite(threshold) or threshold < 0:
        raise BatchInputError(f"threshold must be a finite number >= 0, got {threshold!r}")
    length = len(row.columns)
    try:
        trainer = np.asarray(trainer_logprobs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise BatchInputError(f"trainer_logprobs must be numbers: {exc}") from exc
    if trainer.shape != (length,):
        raise BatchInputError(f"trainer_logprobs must have the row's {length} values, got shape {trainer.shape}")
    columns = row.as_numpy()
    generated = columns.token_mask != 0
    if not np.isfinite(trainer[generated]).all():
        raise BatchInputError("trainer_logprobs must be finite at every generated position")
    # The staged values exactly: float32 columns hold them exactly when the row is packed, else the tuples do.
    staged = columns.logprobs if row.columns.packed_parts is not None else np.array(row.logprobs, dtype=np.float64)
    difference = np.zeros(length, dtype=np.float64)
    difference[generated] = trainer[generated] - staged[generated].astype(np.float64)
    policy = row.policy_mask()
    return MismatchReport(
        difference=difference,
        policy_mask=policy,
        policy=_mismatch_stats(difference[policy], float(threshold)),
        flagged=_mismatch_stats(difference[generated & ~policy], float(threshold)),
        threshold=float(threshold),
        provenance_known=row.provenance_known,
    )


def _mismatch_stats(r: npt.NDArray[np.float64], threshold: float) -> MismatchStats:
    if not r.size:
        return MismatchStats(0, *(math.nan,) * 6)
    import numpy as np

    magnitude = np.abs(r)
    return MismatchStats(
        tokens=int(r.size),
        max_abs_diff=float(magnitude.max()),
        mean_abs_diff=float(magnitude.mean()),
        fraction_over=float((magnitude > threshold).mean()),
        kl_k1=float((-r).mean()),
        kl_k2=float((r * r / 2).mean()),
        kl_k3=float((np.expm1(r) - r).mean()),
    )
