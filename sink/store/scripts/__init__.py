"""Every Lua script of the package, and :class:`ServerScript`, the one way they are loaded and run.

A script runs to completion before the server handles another command, and
every script touches only keys of one cluster slot (passed in ``KEYS``), so
each is atomic on that slot.

Reply convention: every script returns a table whose first element is an
integer status, a member of one of this module's IntEnums (:class:`StageStatus`, ...) (the stage script, a batch,
returns one status per record instead); any payload follows the status. The
Lua text gets the numbers from the enums (``$NAME`` placeholders), so
Python and Lua cannot disagree.

Running: every script is a function of :data:`LIBRARY` (``FCALL`` on Redis >= 7.0 and Valkey, after
``staging-sink setup``), or ``EVALSHA`` on Redis 6.2; :mod:`sink.store.scripts.runner` decides per server.
A caller that pipelines (the sink's group commit) queues with :meth:`ServerScript.queue` and, on a
:meth:`ServerScript.missing` reply, calls :meth:`ServerScript.recover` and sends the pipeline again.

One module per role: :mod:`~sink.store.scripts.status` (the status codes and :data:`LIBRARY`),
:mod:`~sink.store.scripts.runner` (loading and running), and the scripts by family:
:mod:`~sink.store.scripts.staging` (staged records and ledgers), :mod:`~sink.store.scripts.consumer` (consumer
groups, claims, GRPO groups) and :mod:`~sink.store.scripts.gym` (NeMo Gym's transport). This package imports every
family, so importing any of its modules registers every script in :data:`LIBRARY` before the library is first
loaded.
"""

from __future__ import annotations

from sink.store.scripts.consumer import (
    CLAIM_SCRIPT,
    GIVE_BACK_SCRIPT,
    GROUP_CLOSE_SCRIPT,
    GROUP_DUE_SCRIPT,
    GROUP_RECORD_SCRIPT,
    GROUP_SEAL_SCRIPT,
    GROUP_TAKE_SCRIPT,
    RELEASE_SCRIPT,
    RETIRE_CONSUMER_SCRIPT,
    TOUCH_SCRIPT,
)
from sink.store.scripts.gym import GYM_SCRIPT
from sink.store.scripts.runner import ServerScript
from sink.store.scripts.staging import (
    APPEND_AFTER_STAGE_SCRIPT,
    APPEND_SCRIPT,
    CALLS_ENTRY_FIELDS,
    CLEAR_SCRIPT,
    HAS_ROWS_SCRIPT,
    LEDGER_DELETE_SCRIPT,
    LEDGER_RETIRE_SCRIPT,
    READ_SCRIPT,
    STAGE_SCRIPT,
)

# The status codes and the library live in .status; the scripts in .staging, .consumer and .gym (re-exported here).
from sink.store.scripts.status import (
    LIBRARY,
    AppendStatus,
    ClaimStatus,
    GroupStatus,
    GymStatus,
    LedgerStatus,
    RemovalStatus,
    ScriptDone,
    StageStatus,
)

__all__ = (
    "APPEND_AFTER_STAGE_SCRIPT",
    "APPEND_SCRIPT",
    "CALLS_ENTRY_FIELDS",
    "CLAIM_SCRIPT",
    "CLEAR_SCRIPT",
    "GIVE_BACK_SCRIPT",
    "GROUP_CLOSE_SCRIPT",
    "GROUP_DUE_SCRIPT",
    "GROUP_RECORD_SCRIPT",
    "GROUP_SEAL_SCRIPT",
    "GROUP_TAKE_SCRIPT",
    "GYM_SCRIPT",
    "HAS_ROWS_SCRIPT",
    "LEDGER_DELETE_SCRIPT",
    "LEDGER_RETIRE_SCRIPT",
    "LIBRARY",
    "READ_SCRIPT",
    "RELEASE_SCRIPT",
    "RETIRE_CONSUMER_SCRIPT",
    "STAGE_SCRIPT",
    "TOUCH_SCRIPT",
    "AppendStatus",
    "ClaimStatus",
    "GroupStatus",
    "GymStatus",
    "LedgerStatus",
    "RemovalStatus",
    "ScriptDone",
    "ServerScript",
    "StageStatus",
)
