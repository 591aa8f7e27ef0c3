"""Which staging keys a rollout may name, and which it may delete (contract §2.5).

A staging key minted by the sink is ``<owner>/<call>`` or, for a generation-cut chunk,
``<owner>/<call>/cut/<checkpoint>/<seq>``. A ledger row of rollout ``R`` is owned by its
``capture_key`` (``None`` = ``R``), which must be ``R`` itself or another attempt of the same rollout
(``<base>-a<n>``, contract §9); its staging key must belong to that owner. Deletions made on behalf of
``R`` (the reader's ``ack``, the cleanup of a retired duplicate) only ever touch keys whose owner is
``R``: keys of earlier attempts are retained for their own cleanup, keys of other rollouts never reach
a delete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sink.contract.records import CallRecord
from sink.contract.skip_codes import SkipCode
from sink.errors import StagingKeyOwnershipError
from sink.keys import validate_rollout_id

__all__ = (
    "check_chain_ownership",
    "check_row_ownership",
    "is_call_staging_key",
    "keys_owned_by",
    "ownership_problem",
    "same_rollout",
)


_ATTEMPT_SUFFIX = re.compile(r"-a[0-9]+\Z")
_CUT_SUFFIX = re.compile(r"/cut/([A-Za-z0-9._-]+)/(0|[1-9][0-9]*)\Z")


def _base(rollout_id: str) -> str:
    return _ATTEMPT_SUFFIX.sub("", rollout_id)


def same_rollout(rollout_id: str, capture_key: str) -> bool:
    """Whether *capture_key* is *rollout_id* or another attempt of the same rollout (``<base>-a<n>``)."""
    return capture_key == rollout_id or _base(capture_key) == _base(rollout_id)


def is_call_staging_key(staging_key: str, owner: str, call_id: str) -> bool:
    """Whether *staging_key* is ``owner/call_id`` or one of that call's generation-cut keys."""
    own = f"{owner}/{call_id}"
    if staging_key == own:
        return True
    return staging_key.startswith(own) and _CUT_SUFFIX.fullmatch(staging_key[len(own) :]) is not None


def _owner_of_key(staging_key: str) -> str | None:
    owner, sep, rest = staging_key.partition("/")
    if not sep or not rest:
        return None
    try:
        return validate_rollout_id(owner)
    except ValueError:
        return None


def ownership_problem(rollout_id: str, staging_key: str, capture_key: str | None) -> tuple[SkipCode, str] | None:
    """``(skip code, detail)`` when a row of *rollout_id* may not name *staging_key*, else ``None``."""
    owner = capture_key or rollout_id
    if not same_rollout(rollout_id, owner):
        return SkipCode.FOREIGN_CAPTURE_KEY, f"capture_key {owner!r} is not rollout {rollout_id!r} or an attempt of it"
    if _owner_of_key(staging_key) != owner:
        return (
            SkipCode.FOREIGN_STAGING_KEY,
            f"staging key {staging_key!r} is not a key of {owner!r} (rollout {rollout_id!r})",
        )
    return None


def check_row_ownership(rollout_id: str, record: CallRecord) -> None:
    """Refuse a ledger row of *rollout_id* that names another rollout's key or capture key.

    :raises StagingKeyOwnershipError: the row's owner or staging key is not *rollout_id*'s (nothing changed).
    """
    problem = ownership_problem(rollout_id, record.staging_key, record.capture_key)
    if problem is None and not is_call_staging_key(
        record.staging_key, record.capture_key or rollout_id, record.model_call_id
    ):
        problem = (
            SkipCode.FOREIGN_STAGING_KEY,
            f"staging key {record.staging_key!r} is not a key of call {record.model_call_id!r}",
        )
    if problem is not None:
        raise StagingKeyOwnershipError(f"ledger row of rollout {rollout_id!r}: {problem[1]}")


def check_chain_ownership(rollout_id: str, staging_chain: Iterable[str]) -> None:
    """Refuse a staging chain naming a key that belongs to neither *rollout_id* nor another attempt of it.

    :raises StagingKeyOwnershipError: a key is malformed or another rollout's (nothing changed).
    """
    for key in staging_chain:
        owner = _owner_of_key(key)
        if owner is None or not same_rollout(rollout_id, owner):
            raise StagingKeyOwnershipError(f"staging chain of rollout {rollout_id!r} names {key!r}")


def keys_owned_by(rollout_id: str, staging_keys: Iterable[str]) -> list[str]:
    """The distinct keys of *staging_keys* whose owner is *rollout_id* (malformed and foreign keys dropped)."""
    return [key for key in dict.fromkeys(staging_keys) if _owner_of_key(key) == rollout_id]
