"""Parent resolution over a rollout's custody rows (contract §6.5).

Storage-neutral: both capture ledgers read a rollout's rows (in append order)
and hand the decoded custody rows to :func:`resolve_from_rows`, so the
in-memory and the Redis ledger cannot disagree on which parent a request
continues.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sink.contract.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    conversation_digest,
    is_model_authored,
)

__all__ = (
    "AMBIGUOUS_REASON",
    "NO_MATCH_REASON",
    "RETIRED_REASON",
    "LineageMatch",
    "LineageResolution",
    "LineageStatus",
    "is_root_request",
    "resolve_from_rows",
)

NO_MATCH_REASON = "no_match"
AMBIGUOUS_REASON = "ambiguous"
RETIRED_REASON = "retired"


class LineageStatus(StrEnum):
    """Outcome of :meth:`CaptureLedger.resolve`."""

    ROOT = "ROOT"
    """The request carries no model-authored item: a new text root."""
    RESOLVED = "RESOLVED"
    """Exactly one parent (after collapsing identical retries) continues into the request."""
    UNRESOLVED = "UNRESOLVED"
    """No parent, several distinct parents, or a retired rollout."""


@dataclass(frozen=True, slots=True)
class LineageMatch:
    """The parent a request continues, as the gate needs it for a ``token_in`` admission.

    ``digest`` is the parent's ``cumulative_hash`` and ``prev_len`` its
    ``cum_len``; ``cumulative_token_ids`` is always empty for custody rows
    (the tokens live in the staging store, reachable via ``staging_chain``).
    """

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...]
    prev_len: int
    chain_hash: str


@dataclass(frozen=True, slots=True)
class LineageResolution:
    """``status`` plus the ``match`` (only when ``RESOLVED``), an informational ``reason`` and, when ambiguous, the
    ``candidates``.

    :raises ValueError: ``match`` is present without ``RESOLVED`` or missing with it.
    """

    status: LineageStatus
    match: LineageMatch | None = None
    reason: str | None = None
    candidates: tuple[str, ...] = ()
    """For an ambiguous request: the call ids of the distinct parents it matches (sorted)."""

    def __post_init__(self) -> None:
        if (self.status is LineageStatus.RESOLVED) != (self.match is not None):
            raise ValueError("a lineage match is present exactly when the status is RESOLVED")


def is_root_request(request_items: Sequence[dict[str, Any]]) -> bool:
    """Whether a request carries no model-authored item: a new text root (contract §6.5 step 2).

    :raises ValueError: an item is not a dict or has an unfingerprintable shape.
    """
    return assistant_fingerprint(request_items) == ""


_Candidate = tuple[str, int, str, tuple[str, ...], str]


def _latest_reply(
    items: Sequence[dict[str, Any]], candidates: list[_Candidate], context_lens: dict[str, int]
) -> list[_Candidate]:
    """Of several matching candidates, those whose reply starts latest but not after the request's last
    model-authored item (§6.5).

    Several calls match one request when a reply added nothing to the fingerprint (an empty assistant message):
    the calls before and after it then carry the same assistant text. The parent is the call whose reply is the
    request's last model-authored item, so its context (``context_len`` items) ends closest before that item; a
    call whose reply would sit after it (a retry of an earlier turn) is not the parent.
    """
    last = max((index for index, item in enumerate(items) if is_model_authored(item)), default=-1)
    fitting = [candidate for candidate in candidates if context_lens[candidate[0]] <= last]
    if not fitting:
        return candidates
    latest = max(context_lens[candidate[0]] for candidate in fitting)
    return [candidate for candidate in fitting if context_lens[candidate[0]] == latest]


def _candidate(row: Mapping[str, Any]) -> _Candidate | None:
    """``(model_call_id, cum_len, cumulative_hash, staging_chain, chain_hash)`` of a usable row."""
    record = row.get("record")
    chain = row.get("staging_chain")
    if not isinstance(record, Mapping) or not isinstance(chain, list):
        return None
    call_id = record.get("model_call_id")
    cum_len = record.get("cum_len")
    cumulative_hash = record.get("cumulative_hash")
    chain_hash = record.get("chain_hash")
    if not (isinstance(call_id, str) and call_id and type(cum_len) is int):
        return None
    if not (isinstance(cumulative_hash, str) and cumulative_hash and isinstance(chain_hash, str) and chain_hash):
        return None  # a malformed row is reported by the manifest; it can never be a parent
    if not all(isinstance(key, str) for key in chain):
        return None
    return call_id, cum_len, cumulative_hash, tuple(chain), chain_hash


def resolve_from_rows(request_items: Sequence[dict[str, Any]], rows: Iterable[Mapping[str, Any]]) -> LineageResolution:
    """Resolve the parent of a request from a rollout's decoded custody rows (contract §6.5 steps 2-4).

    The retired check (step 1) is the caller's: it must read the fence and
    the rows atomically (a root, :func:`is_root_request`, needs only the fence).

    :raises ValueError: an item is not a dict or has an unfingerprintable shape.
    """
    items = list(request_items)
    fingerprint = assistant_fingerprint(items)
    if fingerprint == "":
        return LineageResolution(LineageStatus.ROOT)
    context_digests: dict[int, str] = {}
    candidates: list[_Candidate] = []
    context_lens: dict[str, int] = {}
    for row in rows:
        if row.get("fingerprint_version") != FINGERPRINT_VERSION or row.get("fingerprint") != fingerprint:
            continue
        context_len = row.get("context_len")
        if type(context_len) is not int or context_len < 0 or context_len > len(items):
            continue
        if context_len not in context_digests:
            context_digests[context_len] = conversation_digest(items[:context_len])
        if row.get("context_digest") != context_digests[context_len]:
            continue
        candidate = _candidate(row)
        if candidate is not None:
            candidates.append(candidate)
            context_lens[candidate[0]] = context_len
    if not candidates:
        return LineageResolution(LineageStatus.UNRESOLVED, reason=NO_MATCH_REASON)
    if len({(cumulative_hash, cum_len) for _, cum_len, cumulative_hash, _, _ in candidates}) > 1:
        candidates = _latest_reply(items, candidates, context_lens)
    if len({(cumulative_hash, cum_len) for _, cum_len, cumulative_hash, _, _ in candidates}) > 1:
        ids = tuple(sorted({candidate[0] for candidate in candidates}))
        return LineageResolution(LineageStatus.UNRESOLVED, reason=AMBIGUOUS_REASON, candidates=ids)
    # Identical retries (same full token sequence) are interchangeable: take the smallest id.
    call_id, cum_len, cumulative_hash, chain, chain_hash = min(candidates, key=lambda c: c[0])
    match = LineageMatch(
        model_call_id=call_id,
        cumulative_token_ids=(),
        digest=cumulative_hash,
        staging_chain=chain,
        prev_len=cum_len,
        chain_hash=chain_hash,
    )
    return LineageResolution(LineageStatus.RESOLVED, match=match)
