"""Receipt assembly: manifest + scored response -> :class:`RolloutReceipt` (contract §7.1 steps 1–4).

:func:`build_receipt` is a pure, deterministic function; it reads no store.
Its result always lands in exactly one attribution state of §3.11:

* manifest unreadable (``None``): state 3, poisoned with
  ``manifest_unavailable``, no attribution stage;
* otherwise the witness resolver runs; the heuristic walk runs only when no
  witness named a row and nothing was declared (§10.4); the method is stamped
  (``heuristic`` whenever the walk ran), so the receipt is state 1 or 2.

Poisoning: the first manifest failure's reason (manifest order) wins, else the
attribution failure reason (the witness trail for a declaration miss or a
witness disagreement, the walk's ``TERMINAL_*`` reason for a failed walk).

A manifest that repeats a ``model_call_id`` cannot be carried by a valid
receipt. We keep the first row of each id, skip attribution (no witness can
name one of two rows with the same id) and record the walk's
``duplicate_call_id`` outcome, which poisons the rollout.
"""

from __future__ import annotations

from typing import Final, Literal

from sink.contract.records import (
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_SELECTED,
    CallRecord,
    RolloutManifest,
    RolloutReceipt,
)
from sink.rollout.terminal import resolve_terminal, select_terminal_call

__all__ = (
    "MANIFEST_UNAVAILABLE_REASON",
    "build_receipt",
)

MANIFEST_UNAVAILABLE_REASON: Final = "manifest_unavailable"


def _join(*reasons: str | None) -> str | None:
    return ",".join(reason for reason in reasons if reason) or None


def _first_of_each_id(records: list[CallRecord]) -> list[CallRecord]:
    kept: dict[str, CallRecord] = {}
    for row in records:
        kept.setdefault(row.model_call_id, row)
    return list(kept.values())


def build_receipt(
    manifest: RolloutManifest | None,
    *,
    rollout_id: str,
    reward: float | None,
    response: object = None,
    declared_response_id: str | None = None,
) -> RolloutReceipt:
    """Assemble the token-free receipt of one finished rollout.

    :param manifest: the rollout's manifest, or ``None`` when it could not be
        read or parsed (including a retired rollout).
    :param response: the scored response object (a dict), used by the
        ``response_id`` and ``content`` witnesses.
    :param declared_response_id: the response id the harness says it kept;
        authoritative when non-empty.
    :raises ValueError: ``manifest.rollout_id`` is not *rollout_id*.
    :raises pydantic.ValidationError: *rollout_id* is empty or *reward* is
        not finite (both caller errors; a ``ValueError``).
    """
    if manifest is None:
        return RolloutReceipt(
            rollout_id=rollout_id,
            reward=reward,
            capture_poisoned=True,
            failure_reason=MANIFEST_UNAVAILABLE_REASON,
        )
    if manifest.rollout_id != rollout_id:
        raise ValueError(f"manifest of rollout {manifest.rollout_id!r} cannot build a receipt for {rollout_id!r}")
    records = manifest.records
    rows = _first_of_each_id(records)
    terminal_id: str | None
    trail: str | None
    selection: Literal["declared", "response_id", "content", "heuristic"]
    attribution_failure: str | None = None
    if len(rows) != len(records):
        terminal_id, selection, trail = None, "heuristic", TERMINAL_DUPLICATE_CALL_ID
        attribution_failure = TERMINAL_DUPLICATE_CALL_ID
    else:
        attribution = resolve_terminal(records, response, declared_response_id=declared_response_id)
        terminal_id, trail = attribution.model_call_id, attribution.reason
        if attribution.method is not None:
            # A witness attributed the row, or a declaration / disagreement
            # decided the failure: authoritative, no fallback (§10.4).
            selection = attribution.method
            if terminal_id is None:
                attribution_failure = trail
        else:
            walk = select_terminal_call(records)
            selection = "heuristic"
            terminal_id = walk.terminal_model_call_id
            trail = _join(trail, walk.reason)
            if walk.reason != TERMINAL_SELECTED:
                attribution_failure = walk.reason
    failure_reason = manifest.failures[0].reason if manifest.failures else attribution_failure
    return RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        terminal_model_call_id=terminal_id,
        manifest=rows,
        capture_poisoned=failure_reason is not None,
        failure_reason=failure_reason,
        terminal_selection=selection,
        terminal_attribution_reason=trail,
    )
