"""Terminal-call attribution: the witness resolver and the heuristic walk (contract §7.2–§7.4).

Both functions are pure: they read manifest rows (and the scored response)
and never raise for any data they are given.

``TerminalAttribution.method`` encodes whether the receipt assembler may fall
back to the heuristic walk:

* success: the first witness that named the row (``declared``,
  ``response_id`` or ``content``);
* a declaration that matched no row or several non-collapsing rows:
  ``declared`` (authoritative, no fallback);
* witnesses that named different rows: the highest-precedence witness
  (no fallback);
* no witness named a row and nothing was declared: ``None``, the only case
  in which the caller may run :func:`select_terminal_call`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from sink.contract.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, is_model_authored
from sink.contract.records import (
    TERMINAL_AMBIGUOUS,
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_NO_RECORDS,
    TERMINAL_NO_ROOT,
    TERMINAL_ORPHANED_ROW,
    TERMINAL_SELECTED,
    CallRecord,
)

__all__ = (
    "CONTENT_AMBIGUOUS",
    "DECLARED_AMBIGUOUS",
    "DECLARED_NOT_CAPTURED",
    "NO_CONTENT_MATCH",
    "NO_MODEL_AUTHORED_OUTPUT",
    "NO_RESPONSE_OBJECT",
    "RESPONSE_HAS_NO_ID",
    "RESPONSE_HAS_NO_OUTPUT",
    "RESPONSE_ID_AMBIGUOUS",
    "RESPONSE_ID_NO_MATCH",
    "RESPONSE_OUTPUT_UNFINGERPRINTABLE",
    "TerminalAttribution",
    "TerminalSelection",
    "WitnessMethod",
    "collapse_candidates",
    "resolve_terminal",
    "select_terminal_call",
)

WitnessMethod = Literal["declared", "response_id", "content"]

# Witness-trail reason codes (contract §7.2).
DECLARED_NOT_CAPTURED = "declared_terminal_not_captured"
DECLARED_AMBIGUOUS = "declared_ambiguous"
NO_RESPONSE_OBJECT = "no_response_object"
RESPONSE_HAS_NO_ID = "response_has_no_id"
RESPONSE_ID_NO_MATCH = "response_id_no_match"
RESPONSE_ID_AMBIGUOUS = "response_id_ambiguous"
RESPONSE_HAS_NO_OUTPUT = "response_has_no_output"
RESPONSE_OUTPUT_UNFINGERPRINTABLE = "response_output_unfingerprintable"
NO_MODEL_AUTHORED_OUTPUT = "no_model_authored_output"
NO_CONTENT_MATCH = "no_content_match"
CONTENT_AMBIGUOUS = "content_ambiguous"


class TerminalSelection(NamedTuple):
    """Outcome of the heuristic parent-link walk: a row id on ``selected``, else ``None``."""

    terminal_model_call_id: str | None
    reason: str


class TerminalAttribution(NamedTuple):
    """Outcome of the witness resolver.

    ``model_call_id`` is the attributed row, or ``None``. ``method`` is the
    witness that chose it, or on failure the stage that decided the failure
    (``None`` when no witness named a row and no declaration was made, the only
    state that allows the heuristic fallback). ``reason`` is the witness trail
    joined with ``,`` (``None`` when empty).
    """

    model_call_id: str | None
    method: WitnessMethod | None
    reason: str | None


# --- collapse rule (§7.3) ---------------------------------------------------


def collapse_candidates(candidates: Sequence[CallRecord]) -> CallRecord | None:
    """Reduce witness candidates to one row, or ``None`` when they are absent or distinct.

    Several candidates that share one (``cumulative_hash``, ``chain_hash``,
    ``cum_len``) are identical retries; the smallest ``model_call_id`` wins.
    """
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    identities = {(row.cumulative_hash, row.chain_hash, row.cum_len) for row in candidates}
    if len(identities) != 1:
        return None
    return min(candidates, key=lambda row: row.model_call_id)


# --- heuristic walk (§7.4) ----------------------------------------------------


def _survivors(rows: list[CallRecord], children: Mapping[str, list[CallRecord]]) -> list[CallRecord]:
    extended = [row for row in rows if children.get(row.model_call_id)]
    return extended or rows


def select_terminal_call(records: Sequence[CallRecord]) -> TerminalSelection:
    """Choose the terminal call by walking parent links from the root (contract §7.4).

    Childless siblings of an extended call (abandoned retries) are ignored;
    two or more surviving siblings are ``ambiguous_terminal``.
    """
    if not records:
        return TerminalSelection(None, TERMINAL_NO_RECORDS)
    ids = [row.model_call_id for row in records]
    known = set(ids)
    if len(known) != len(ids):
        return TerminalSelection(None, TERMINAL_DUPLICATE_CALL_ID)
    if any(row.parent_call_id is not None and row.parent_call_id not in known for row in records):
        return TerminalSelection(None, TERMINAL_ORPHANED_ROW)
    children: dict[str, list[CallRecord]] = {}
    roots: list[CallRecord] = []
    for row in records:  # manifest order is kept inside every bucket
        if row.parent_call_id is None:
            roots.append(row)
        else:
            children.setdefault(row.parent_call_id, []).append(row)
    if not roots:
        return TerminalSelection(None, TERMINAL_NO_ROOT)
    position = {row.model_call_id: index for index, row in enumerate(records)}
    node = min(
        _survivors(roots, children),
        key=lambda row: (row.admitted_at is None, row.admitted_at or 0.0, position[row.model_call_id]),
    )
    # Every row has one parent, so a walk down from a root cannot enter a cycle
    # and visits each row at most once.
    while True:
        kids = children.get(node.model_call_id)
        if not kids:
            return TerminalSelection(node.model_call_id, TERMINAL_SELECTED)
        pool = _survivors(kids, children)
        if len(pool) > 1:
            return TerminalSelection(None, TERMINAL_AMBIGUOUS)
        node = pool[0]


# --- witness resolver (§7.2) --------------------------------------------------


def _response_id_witness(records: Sequence[CallRecord], response: Mapping[Any, Any]) -> CallRecord | str:
    response_id = response.get("id")
    if not isinstance(response_id, str) or not response_id:
        return RESPONSE_HAS_NO_ID
    matches = [row for row in records if row.response_id == response_id]
    if not matches:
        return RESPONSE_ID_NO_MATCH
    return collapse_candidates(matches) or RESPONSE_ID_AMBIGUOUS


def _content_witness(records: Sequence[CallRecord], response: Mapping[Any, Any]) -> CallRecord | str:
    output = response.get("output")
    if not isinstance(output, list) or not output:
        return RESPONSE_HAS_NO_OUTPUT
    items = [item for item in output if isinstance(item, Mapping)]
    try:
        target = assistant_fingerprint(items)
        tail_start = len(items)
        while tail_start > 0 and is_model_authored(items[tail_start - 1]):
            tail_start -= 1
        tail = assistant_fingerprint(items[tail_start:]) if 0 < tail_start < len(items) else ""
    except (ValueError, TypeError, RecursionError):
        return RESPONSE_OUTPUT_UNFINGERPRINTABLE
    if not target:
        return NO_MODEL_AUTHORED_OUTPUT
    output_targets = {target, tail} - {""}
    candidates = [
        row
        for row in records
        if row.fingerprint_version == FINGERPRINT_VERSION
        and (
            (row.continuation_fingerprint is not None and row.continuation_fingerprint == target)
            or (row.output_fingerprint is not None and row.output_fingerprint in output_targets)
        )
    ]
    if not candidates:
        return NO_CONTENT_MATCH
    return collapse_candidates(candidates) or CONTENT_AMBIGUOUS


def _join(reasons: list[str]) -> str | None:
    return ",".join(reasons) or None


def resolve_terminal(
    records: Sequence[CallRecord],
    response: object,
    *,
    declared_response_id: str | None = None,
) -> TerminalAttribution:
    """Attribute the scored response to one manifest row by witnesses (contract §7.2).

    Witnesses in precedence order: the declared response id, the response's
    ``id``, and its output content fingerprint. Never raises; every witness
    that did not name a row leaves a reason in the trail.
    """
    reasons: list[str] = []
    witnesses: list[tuple[WitnessMethod, CallRecord]] = []
    if declared_response_id:
        matches = [row for row in records if row.response_id == declared_response_id]
        if not matches:
            return TerminalAttribution(None, "declared", DECLARED_NOT_CAPTURED)
        declared_row = collapse_candidates(matches)
        if declared_row is None:
            return TerminalAttribution(None, "declared", DECLARED_AMBIGUOUS)
        witnesses.append(("declared", declared_row))
    if not isinstance(response, Mapping):
        reasons.append(NO_RESPONSE_OBJECT)
    else:
        stages: tuple[tuple[WitnessMethod, CallRecord | str], ...] = (
            ("response_id", _response_id_witness(records, response)),
            ("content", _content_witness(records, response)),
        )
        for method, outcome in stages:
            if isinstance(outcome, str):
                reasons.append(outcome)
            else:
                witnesses.append((method, outcome))
    if not witnesses:
        return TerminalAttribution(None, None, _join(reasons))
    first_method = witnesses[0][0]
    # Witnesses naming one row, or identical retries, collapse to one row.
    chosen = collapse_candidates([row for _, row in witnesses])
    if chosen is None:
        named = ";".join(f"{method}={row.model_call_id}" for method, row in witnesses)
        reasons.append(f"witness_disagreement[{named}]")
        return TerminalAttribution(None, first_method, _join(reasons))
    if len(witnesses) > 1:
        reasons.append("corroborated_by=" + "+".join(method for method, _ in witnesses[1:]))
    return TerminalAttribution(chosen.model_call_id, first_method, _join(reasons))
