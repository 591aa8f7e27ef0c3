"""The status codes every Lua script of :mod:`sink.store.scripts` returns first: one IntEnum per script family whose values
are filled into the Lua text (``$NAME``), so Python and Lua cannot disagree; and :data:`LIBRARY`, the function
library every script is registered in (:func:`library_script`)."""

from __future__ import annotations

from enum import IntEnum
from typing import Final

from sink.store.scripts.runner import ScriptLibrary, ServerScript

__all__ = (
    "LIBRARY",
    "STATUS_CODES",
    "AppendStatus",
    "ClaimStatus",
    "GroupStatus",
    "GymStatus",
    "LedgerStatus",
    "RemovalStatus",
    "ScriptDone",
    "StageStatus",
    "library_script",
)


class ScriptDone(IntEnum):
    """The script ran; its payload follows (clear, touch)."""

    DONE = 0


class RemovalStatus(IntEnum):
    """Removal scripts (ledger retire/delete, claim release, consumer retire): whether something was removed."""

    NOT_REMOVED = 0
    REMOVED = 1
    DELETE_STALE = 2
    """The delete script's reply when the rollout's ``calls`` stream changed since it was read (nothing changed)."""


class StageStatus(IntEnum):
    """The stage script's status for one record."""

    CONFLICT = 0
    WRITTEN = 1
    SAME = 2
    REPAIRED = 3
    """A present record with the same digest but other bytes (corrupt) was rewritten with the validated blob."""
    WRONG_TYPE = -1
    RETIRED = -2


class AppendStatus(IntEnum):
    """The ledger append script's status."""

    APPENDED = 0
    DUPLICATE = 1
    FENCED = 2
    CONFLICT = 3
    NOT_STAGED = 4
    """The append-after-stage script's refusal: the record the row names is not stored under its key with its digest
    (its stage did not write it): nothing written."""


class LedgerStatus(IntEnum):
    """Ledger reads: the rollout is live (payload follows) or retired."""

    OPEN = 0
    FENCED = 1


class ClaimStatus(IntEnum):
    """The claim script's status."""

    CLAIMED = 0
    DUPLICATE = 1
    RETIRED = 2


class GroupStatus(IntEnum):
    """GRPO group record scripts (:mod:`sink.rollout.assembler`): open (payload: first_at); complete or sealed, its
    member set frozen and not yet published (payload: size, mismatch, first_at, members); published already; no
    record; the member came after its group's member set was frozen (not recorded).
    """

    OPEN = 0
    COMPLETE = 1
    SEALED = 2
    PUBLISHED = 3
    GONE = 4
    LATE = 5


class GymStatus(IntEnum):
    """The Gym transport's script (:mod:`sink.store.scripts.gym`): one status per operation of a batch."""

    OK = 0
    SAME = 1
    CONFLICT = 2
    FROZEN = 3
    RETIRED = 4
    WRONG_TYPE = 5
    DROP_REFUSED = 6


_PLACEHOLDER_PREFIXES: Final[tuple[tuple[str, type[IntEnum]], ...]] = (
    ("", ScriptDone),
    ("", RemovalStatus),
    ("STAGE_", StageStatus),
    ("APPEND_", AppendStatus),
    ("LEDGER_", LedgerStatus),
    ("CLAIM_", ClaimStatus),
    ("GROUP_", GroupStatus),
    ("GYM_", GymStatus),
)

STATUS_CODES: Final[dict[str, int]] = {
    prefix + member.name: int(member) for prefix, statuses in _PLACEHOLDER_PREFIXES for member in statuses
}
"""The ``$NAME`` placeholders of the Lua text (``$STAGE_WRITTEN``, ``$REMOVED``, ...) and their numbers."""


LIBRARY: Final = ScriptLibrary("staging_sink")
"""Every script of :mod:`sink.store.scripts`, as one function library (see :mod:`sink.store.scripts.runner`)."""


def library_script(name: str, template: str, **extra: str) -> ServerScript:
    """Register the script *name* in :data:`LIBRARY`, its ``$NAME`` placeholders filled from the status codes."""
    return LIBRARY.script(name, template, codes=STATUS_CODES, **extra)
