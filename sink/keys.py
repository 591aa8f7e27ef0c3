"""Every Redis key and stream name of the staging layout (contract §11.1).

One namespace prefix ``ns`` (default ``stg``); every per-rollout key carries
the hash tag ``{R}`` so a rollout lives in one cluster slot. Only the sink and
the source derive a Redis key from a staging key (:func:`record_key`); every
other component treats staging keys as opaque.

The NeMo Gym transport's keys are a family of their own, ``ns:gym:{R}...``
(:func:`gym_keys`): no key of the RL path starts with ``ns:gym:``, so an ACL
pattern of one family never matches a key of the other, whatever a call id
holds.
"""

from __future__ import annotations

import re
import zlib
from typing import NamedTuple

from sink.errors import InvalidCallIdError

__all__ = (
    "DEFAULT_NAMESPACE",
    "GymKeys",
    "calls_stream",
    "check_call_id",
    "claim_key",
    "dead_letter_stream",
    "done_stream",
    "fence_key",
    "group_keys",
    "gym_key_kind",
    "gym_key_prefix",
    "gym_keys",
    "incoming_key",
    "last_weight_version_key",
    "ledger_ids_key",
    "ledger_stream",
    "ledger_text_key",
    "open_groups_key",
    "receipt_key",
    "receipts_stream",
    "record_key",
    "rollout_of_staging_key",
    "shard_of",
    "validate_rollout_id",
    "weight_version_key",
)

DEFAULT_NAMESPACE = "stg"
_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9._-]+")


def validate_rollout_id(rollout_id: object) -> str:
    """Return *rollout_id* if it is a valid rollout id (contract §6.8).

    :raises ValueError: empty, not a ``str``, or containing a character other
        than ASCII letters, digits, ``.``, ``_`` and ``-``.
    """
    if type(rollout_id) is not str or _ROLLOUT_ID_RE.fullmatch(rollout_id) is None:
        raise ValueError(f"Invalid rollout id: {rollout_id!r}")
    return rollout_id


def check_call_id(model_call_id: str) -> str:
    """Return *model_call_id* unless its staging key could be read as a generation-cut chunk's key.

    Call ``C``'s cut chunks live under ``R/C/cut/<checkpoint>/<seq>``, so a call id containing ``/cut/``
    (``c0/cut/ck/0``) would share a key with call ``c0``'s chunk.

    :raises InvalidCallIdError: the id contains ``/cut/``.
    """
    if "/cut/" in model_call_id:
        raise InvalidCallIdError(
            f"model call id {model_call_id!r} contains '/cut/' and would collide with a generation-cut key"
        )
    return model_call_id


def rollout_of_staging_key(staging_key: str) -> str:
    """The rollout id a staging key minted by this sink belongs to (``R/...``).

    :raises ValueError: the key has no ``R/`` prefix with a valid rollout id,
        or nothing after it.
    """
    rollout_id, sep, rest = staging_key.partition("/")
    if not sep or not rest:
        raise ValueError(f"staging key {staging_key!r} is not of the form '<rollout_id>/<call>'")
    return validate_rollout_id(rollout_id)


def _tag(ns: str, rollout_id: str) -> str:
    return f"{ns}:{{{rollout_id}}}"


def record_key(ns: str, staging_key: str) -> str:
    """Redis key of the record staged under *staging_key*: ``ns:{R}:rec:<rest>``."""
    rollout_id = rollout_of_staging_key(staging_key)
    return f"{_tag(ns, rollout_id)}:rec:{staging_key[len(rollout_id) + 1 :]}"


def incoming_key(ns: str, rollout_id: str, sequence: int) -> str:
    """Where a record's blob waits, inside the stage's ``MULTI``/``EXEC``, for the stage script to move it to its
    record key: ``ns:{R}:incoming:<sequence>`` (*sequence*: unique among the stages of one transaction).

    The script moves or deletes it in the same transaction, so no client ever sees one; it carries an expiry in
    case a transaction's script failed (the function library missing) after its ``SET`` ran.
    """
    return f"{_tag(ns, rollout_id)}:incoming:{sequence}"


def calls_stream(ns: str, rollout_id: str) -> str:
    """Stream of token-free entries, one per newly staged record."""
    return f"{_tag(ns, rollout_id)}:calls"


def ledger_stream(ns: str, rollout_id: str) -> str:
    """Append-only ledger rows of one rollout."""
    return f"{_tag(ns, rollout_id)}:ledger"


def ledger_ids_key(ns: str, rollout_id: str) -> str:
    """Hash model_call_id -> row fingerprint, for ledger idempotency."""
    return f"{_tag(ns, rollout_id)}:ledger:ids"


def ledger_text_key(ns: str, rollout_id: str) -> str:
    """Hash of the rollout's exact texts (exact-prefix ``/v1/completions``: parent resolution of a text prompt)."""
    return f"{_tag(ns, rollout_id)}:ledger:text"


def fence_key(ns: str, rollout_id: str) -> str:
    """Retire fence of one rollout."""
    return f"{_tag(ns, rollout_id)}:fence"


def receipt_key(ns: str, rollout_id: str) -> str:
    """The immutable receipt of one rollout."""
    return f"{_tag(ns, rollout_id)}:receipt"


def claim_key(ns: str, rollout_id: str) -> str:
    """The trainer-side consumption claim of one rollout (which receipt entry and reader own it)."""
    return f"{_tag(ns, rollout_id)}:claimed"


def done_stream(ns: str, shard: int) -> str:
    """Sharded stream of rollout-finished events."""
    return f"{ns}:done:{shard}"


def receipts_stream(ns: str, shard: int) -> str:
    """Sharded stream of receipts for trainers."""
    return f"{ns}:receipts:{shard}"


def dead_letter_stream(ns: str, name: str) -> str:
    """Stream of entries a consumer group gave up on (``name``: the source stream's role and shard)."""
    return f"{ns}:dead:{name}"


def weight_version_key(ns: str) -> str:
    """The trainer's published weight version of the namespace (a decimal integer string)."""
    return f"{ns}:weight_version"


def last_weight_version_key(ns: str) -> str:
    """The last weight version published in the namespace: written after :func:`weight_version_key` by every
    publish and never deleted by one, so a namespace that has it and no :func:`weight_version_key` had its
    published version deleted."""
    return f"{ns}:weight_version:last"


def shard_of(rollout_id: str, shards: int) -> int:
    """The shard (0..shards-1) of a rollout's ``done``/``receipts`` events: CRC-32 of its id."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return zlib.crc32(rollout_id.encode()) % shards


def group_keys(namespace: str, group_id: str) -> tuple[str, str]:
    """``(meta, members)`` keys of a group's server-side record (one slot: ``{grp:<id>}``)."""
    return f"{namespace}:{{grp:{group_id}}}:meta", f"{namespace}:{{grp:{group_id}}}:members"


def open_groups_key(namespace: str, shard: int) -> str:
    """The index of one ``done`` shard's open GRPO groups (a sorted set: group id by its first member's time),
    swept by every assembler for groups past ``group_timeout_s``."""
    return f"{namespace}:groups:open:{shard}"


class GymKeys(NamedTuple):
    """The NeMo Gym transport's keys of one rollout (:mod:`sink.store.scripts.gym`), in the script's order.

    The sink (``gym_sink``) writes the first four while the rollout is open; the source (``gym_source``) owns
    the last three. A freeze moves the entries into ``snapshot``, out of the sink's reach.
    """

    state: str
    """``ns:gym:{R}``: the sink's state (``version``, ``incomplete``, ``touched_ms``)."""
    entries: str
    """``ns:gym:{R}:entries``: the open rollout's entries by call id."""
    digests: str
    """``ns:gym:{R}:digests``: each entry's digest by call id."""
    intents: str
    """``ns:gym:{R}:intents``: the call ids ``begin_call`` announced."""
    frozen: str
    """``ns:gym:{R}:frozen``: the snapshot's identity (``snapshot_id``, ``version``, ``incomplete``, ``seen``,
    ``touched_ms``); it exists once the rollout is frozen."""
    snapshot: str
    """``ns:gym:{R}:snapshot``: the frozen rollout's entries by call id."""
    tombstone: str
    """``ns:gym:{R}:tombstone``: a dropped (or abandoned) rollout's tombstone, never the RL retire fence."""


def gym_key_prefix(ns: str) -> str:
    """``ns:gym:{``: every key of the NeMo Gym transport starts with it (the rollout id follows, then ``}``)."""
    return f"{ns}:gym:{{"


def gym_key_kind(ns: str, key: str) -> tuple[str, str] | None:
    """``(rollout id, kind)`` of a key of the Gym family (``gym`` for ``ns:gym:{R}``, ``gym:<suffix>`` for
    ``ns:gym:{R}:<suffix>``); ``None`` for any other key."""
    prefix = gym_key_prefix(ns)
    rollout_id, sep, rest = key[len(prefix) :].partition("}")
    if not key.startswith(prefix) or not sep or not rollout_id or (rest and not rest.startswith(":")):
        return None
    return rollout_id, f"gym{rest}"


def gym_keys(ns: str, rollout_id: str) -> GymKeys:
    """The NeMo Gym transport's keys of one rollout: ``ns:gym:{R}`` and ``ns:gym:{R}:<kind>`` (see
    :class:`GymKeys`), in their own family: none of them is a key of the RL path (``ns:{R}:...``)."""
    state = f"{gym_key_prefix(ns)}{rollout_id}}}"
    return GymKeys(
        state,
        f"{state}:entries",
        f"{state}:digests",
        f"{state}:intents",
        f"{state}:frozen",
        f"{state}:snapshot",
        f"{state}:tombstone",
    )
