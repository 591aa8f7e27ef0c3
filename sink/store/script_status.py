"""The status codes every Lua script of :mod:`sink.store.scripts` returns first: Python constants whose values
are filled into the Lua text (``$NAME``), so Python and Lua cannot disagree; and :data:`LIBRARY`, the function
library every script is registered in (:func:`library_script`)."""

from __future__ import annotations

from typing import Final

from sink.store.script_runner import ScriptLibrary, ServerScript

__all__ = (
    "APPEND_APPENDED",
    "APPEND_CONFLICT",
    "APPEND_DUPLICATE",
    "APPEND_FENCED",
    "CLAIM_CLAIMED",
    "CLAIM_DUPLICATE",
    "CLAIM_RETIRED",
    "DELETE_STALE",
    "DONE",
    "GROUP_COMPLETE",
    "GROUP_GONE",
    "GROUP_LATE",
    "GROUP_OWNED",
    "GROUP_SEALED",
    "GROUP_TAKEN",
    "GROUP_WAIT",
    "LEDGER_FENCED",
    "LEDGER_OPEN",
    "LIBRARY",
    "NOT_REMOVED",
    "REMOVED",
    "STAGE_CONFLICT",
    "STAGE_REPAIRED",
    "STAGE_RETIRED",
    "STAGE_SAME",
    "STAGE_WRITTEN",
    "STAGE_WRONG_TYPE",
    "STATUS_CODES",
    "library_script",
)

DONE: Final = 0
"""The script ran; its payload follows (clear, touch)."""
REMOVED: Final = 1
NOT_REMOVED: Final = 0
DELETE_STALE: Final = 2
"""The delete script's reply when the rollout's ``calls`` stream changed since it was read (nothing changed)."""
"""Removal scripts (ledger retire/delete, claim release, consumer retire): whether something was removed."""

STAGE_WRITTEN: Final = 1
STAGE_SAME: Final = 2
STAGE_CONFLICT: Final = 0
STAGE_WRONG_TYPE: Final = -1
STAGE_RETIRED: Final = -2
STAGE_REPAIRED: Final = 3
"""A present record with the same digest but other bytes (corrupt) was rewritten with the validated blob."""

APPEND_APPENDED: Final = 0
APPEND_DUPLICATE: Final = 1
APPEND_FENCED: Final = 2
APPEND_CONFLICT: Final = 3
LEDGER_OPEN: Final = 0
LEDGER_FENCED: Final = 1
"""Ledger reads: the rollout is live (payload follows) or retired."""

CLAIM_CLAIMED: Final = 0
CLAIM_DUPLICATE: Final = 1
CLAIM_RETIRED: Final = 2

GROUP_WAIT: Final = 0
GROUP_OWNED: Final = 1
GROUP_TAKEN: Final = 2
GROUP_COMPLETE: Final = 3
GROUP_SEALED: Final = 4
GROUP_GONE: Final = 5
GROUP_LATE: Final = 6
"""GRPO group scripts: members missing; the caller owns it; a live rank owns it (payload: owner); complete and
now the caller's (payload: size, mismatch, members); timed out and now the caller's (payload: size, mismatch,
members); expired or acknowledged; the member came after its group went out (not recorded)."""


STATUS_CODES: Final = {
    "DONE": DONE,
    "REMOVED": REMOVED,
    "NOT_REMOVED": NOT_REMOVED,
    "DELETE_STALE": DELETE_STALE,
    "STAGE_WRITTEN": STAGE_WRITTEN,
    "STAGE_SAME": STAGE_SAME,
    "STAGE_CONFLICT": STAGE_CONFLICT,
    "STAGE_WRONG_TYPE": STAGE_WRONG_TYPE,
    "STAGE_RETIRED": STAGE_RETIRED,
    "STAGE_REPAIRED": STAGE_REPAIRED,
    "APPEND_APPENDED": APPEND_APPENDED,
    "APPEND_DUPLICATE": APPEND_DUPLICATE,
    "APPEND_FENCED": APPEND_FENCED,
    "APPEND_CONFLICT": APPEND_CONFLICT,
    "LEDGER_OPEN": LEDGER_OPEN,
    "LEDGER_FENCED": LEDGER_FENCED,
    "CLAIM_CLAIMED": CLAIM_CLAIMED,
    "CLAIM_DUPLICATE": CLAIM_DUPLICATE,
    "CLAIM_RETIRED": CLAIM_RETIRED,
    "GROUP_WAIT": GROUP_WAIT,
    "GROUP_OWNED": GROUP_OWNED,
    "GROUP_TAKEN": GROUP_TAKEN,
    "GROUP_COMPLETE": GROUP_COMPLETE,
    "GROUP_SEALED": GROUP_SEALED,
    "GROUP_GONE": GROUP_GONE,
    "GROUP_LATE": GROUP_LATE,
}


LIBRARY: Final = ScriptLibrary("staging_sink")
"""Every script of :mod:`sink.store.scripts`, as one function library (see :mod:`sink.store.script_runner`)."""


def library_script(name: str, template: str, **extra: str) -> ServerScript:
    """Register the script *name* in :data:`LIBRARY`, its ``$NAME`` placeholders filled from the status codes."""
    return LIBRARY.script(name, template, codes=STATUS_CODES, **extra)
