"""The least-privilege policy of the staging roles: what each role may run on which keys (keys: contract §11.1).

:data:`ROLE_POLICIES` is the single table :mod:`sink.ops.access.render` renders into an ``aclfile``.

Each role is a list of :class:`Grant` s: a set of commands and the key patterns they may touch. On servers
with ACL selectors (Redis 7.0+, every Valkey) the first grant becomes the user's root permissions and each
further grant a selector ``(...)``; a command is allowed when one grant allows both the command and all its
keys. So the trainer may ``SET`` the retire fence but not a staged record, and the worker may ``XADD`` to a
``calls`` stream but not ``SET`` it. Grants name the commands that each role's Lua functions run, because the
server checks every command inside a function against the calling user, and checks the function's ``KEYS``
against the grant that allows ``FCALL`` (which needs read-write access to them, even for a read-only one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = (
    "ADMIN_ROLE",
    "CONNECTION_COMMANDS",
    "ROLE_NAMES",
    "ROLE_POLICIES",
    "Grant",
    "KeyPattern",
    "RolePolicy",
)

Access = Literal["R", "W", "RW"]


@dataclass(frozen=True, slots=True)
class KeyPattern:
    """A key glob with ``<ns>`` standing for the namespace, and the access it grants (read, write or both)."""

    pattern: str
    access: Access = "RW"

    def render(self, namespace: str, *, read_write_only: bool) -> str:
        """``~glob``, ``%R~glob`` or ``%W~glob`` (always ``~glob`` with ``read_write_only``)."""
        glob = self.pattern.replace("<ns>", namespace)
        return f"~{glob}" if read_write_only or self.access == "RW" else f"%{self.access}~{glob}"


@dataclass(frozen=True, slots=True)
class Grant:
    """Commands (``xadd``, ``config|get``) and the key patterns they may touch; no patterns: keyless only."""

    commands: tuple[str, ...]
    keys: tuple[KeyPattern, ...] = ()


@dataclass(frozen=True, slots=True)
class RolePolicy:
    """What one role does, and its grants (the first one is the user's root permissions)."""

    purpose: str
    grants: tuple[Grant, ...]

    def commands(self) -> frozenset[str]:
        """Every command of every grant."""
        return frozenset(command for grant in self.grants for command in grant.commands)


def _rw(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "RW")


def _ro(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "R")


def _wo(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "W")


_REC = "<ns>:{*}:rec:*"
_INCOMING = "<ns>:{*}:incoming:*"  # a record's blob inside its stage's transaction (sink.keys.incoming_key)
_CALLS = "<ns>:{*}:calls"
_LEDGER = "<ns>:{*}:ledger"
_LEDGER_IDS = "<ns>:{*}:ledger:ids"
_LEDGER_TEXT = "<ns>:{*}:ledger:text"
_FENCE = "<ns>:{*}:fence"
# The NeMo Gym transport's own key family (sink.keys.gym_keys): no RL key starts with <ns>:gym:, and a rollout id
# holds no "}", so each pattern below matches exactly one kind of key of one family.
_GYM = "<ns>:gym:{*}"
_GYM_ENTRIES = "<ns>:gym:{*}:entries"
_GYM_DIGESTS = "<ns>:gym:{*}:digests"
_GYM_INTENTS = "<ns>:gym:{*}:intents"
_GYM_FROZEN = "<ns>:gym:{*}:frozen"
_GYM_SNAPSHOT = "<ns>:gym:{*}:snapshot"
_GYM_TOMBSTONE = "<ns>:gym:{*}:tombstone"
_GYM_KEYS = (_GYM, _GYM_ENTRIES, _GYM_DIGESTS, _GYM_INTENTS, _GYM_FROZEN, _GYM_SNAPSHOT, _GYM_TOMBSTONE)
_RECEIPT = "<ns>:{*}:receipt"
_CLAIMED = "<ns>:{*}:claimed"
_DONE = "<ns>:done:*"
_RECEIPTS = "<ns>:receipts:*"
_DEAD = "<ns>:dead:*"
_GROUP_META = "<ns>:{grp:*}:meta"
_GROUP_MEMBERS = "<ns>:{grp:*}:members"
_OPEN_GROUPS = "<ns>:groups:open:*"
_WEIGHTS = ("<ns>:weight_version", "<ns>:weight_version:last")  # the published version and its last-published record

CONNECTION_COMMANDS: tuple[str, ...] = (
    "ping",
    "hello",
    "auth",
    "client|setname",
    "client|getname",
    "client|id",
    "client|setinfo",
    "command",
    "asking",
    "readonly",
    "readwrite",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "cluster|info",
)
"""What any redis-py client (plain or cluster) sends besides its real work; every role has these."""

_SCRIPTS = ("fcall", "fcall_ro", "evalsha", "eval")
"""Running the package's scripts: ``FCALL`` of the loaded function library on Redis >= 7.0 and Valkey,
``EVALSHA``/``EVAL`` only on Redis 6.2 (see :data:`COMMANDS_UNTIL`)."""
_TRANSACTIONS = ("multi", "exec", "discard")
_DURABLE_ACK = ("waitaof", "config|get")
"""What every acknowledged write carries in its own round trip (:mod:`sink.store.durability`): ``WAITAOF``
and ``CONFIG GET`` of the persistence settings. ``CONFIG GET`` cannot be limited to some parameters, so it
shows every setting (``masterauth`` included, see the replica role), as it does to the worker and ops roles."""
# sink.store.streams: read, reclaim, acknowledge (XACK + XDEL in one MULTI), count deliveries, and its scripts
# (touch: XPENDING, XCLAIM; retire a consumer: EXISTS, XPENDING, XGROUP DELCONSUMER).
_CONSUMER = (
    "xreadgroup",
    "xautoclaim",
    "xclaim",
    "xack",
    "xdel",
    "xpending",
    "xlen",
    "exists",
    "xgroup|create",
    "xgroup|createconsumer",
    "xgroup|delconsumer",
)

ROLE_POLICIES: Mapping[str, RolePolicy] = {
    "worker": RolePolicy(
        "inference worker: stage records (one MULTI: SET of the blob to an incoming key, then one script: TYPE, "
        "GETRANGE, STRLEN, GET, RENAME incoming to rec, PERSIST, XADD on rec + calls, DEL incoming; EXISTS fence: "
        "a retired rollout refuses late stages), verify the "
        "server's durability (CONFIG GET, INFO), confirm writes (WAIT, WAITAOF), read prefix chains (MGET rec)",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", *_TRANSACTIONS, "config|get", "info", "wait", "waitaof")),
            Grant(_SCRIPTS, (_rw(_REC), _rw(_CALLS), _rw(_FENCE), _rw(_INCOMING))),
            Grant(("type", "getrange", "strlen", "get", "persist", "mget"), (_rw(_REC),)),
            Grant(("rename",), (_rw(_REC), _rw(_INCOMING))),
            Grant(("set", "type", "strlen", "get", "del"), (_rw(_INCOMING),)),
            Grant(("type", "xadd"), (_rw(_CALLS),)),
            Grant(("exists",), (_ro(_FENCE),)),
        ),
    ),
    "gate": RolePolicy(
        "model server (gate): the capture ledger's scripts (EXISTS, HGET, HSET, XADD, XRANGE on ledger, "
        "ledger:ids, fence; retire/delete: SET fence, DEL) and rollout-finished events (XADD done), each "
        "confirmed durable in its round trip (WAITAOF, CONFIG GET); the proxy reads the trainer's published weight "
        "version with it (GET weight_version, weight_version:last)",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", *_DURABLE_ACK)),
            Grant(_SCRIPTS, (_rw(_LEDGER), _rw(_LEDGER_IDS), _rw(_FENCE))),
            Grant(("exists", "xadd", "xrange", "del"), (_rw(_LEDGER),)),
            Grant(("exists", "hget", "hset", "del"), (_rw(_LEDGER_IDS),)),
            Grant(("hgetall", "hset", "expire"), (_rw(_LEDGER_TEXT),)),  # exact-prefix completions' texts
            Grant(("exists", "set", "del"), (_rw(_FENCE),)),
            Grant(("xadd",), (_wo(_DONE),)),
            Grant(("get",), tuple(_ro(p) for p in _WEIGHTS)),
            # `staging-sink retire` checks that an id names something before it fences it
            Grant(("exists",), (_ro(_CALLS), _ro(_RECEIPT), _ro(_CLAIMED))),
        ),
    ),
    "assembler": RolePolicy(
        "assembler: consume done events, read ledgers (script: EXISTS, XRANGE), store the receipt once "
        "(SET NX GET), publish to receipts, dead-letter what cannot be processed; GRPO groups: record members "
        "and freeze or seal groups (script: TIME, EXISTS, HGET, HSETNX, HSET, HEXISTS, HLEN, HMGET, HKEYS), mark "
        "them published (HSET), index open groups and sweep the index (ZADD, ZREM; script: TIME, ZRANGEBYSCORE, "
        "ZCARD); every write confirmed durable in its round trip (WAITAOF, CONFIG GET)",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", "time", *_TRANSACTIONS, *_DURABLE_ACK)),
            Grant(
                _SCRIPTS,
                (_rw(_LEDGER), _rw(_FENCE), _rw(_DONE), _rw(_GROUP_META), _rw(_GROUP_MEMBERS), _rw(_OPEN_GROUPS)),
            ),
            Grant(("exists", "xrange"), (_ro(_LEDGER), _ro(_FENCE))),
            Grant(_CONSUMER, (_rw(_DONE),)),
            Grant(("set", "get"), (_rw(_RECEIPT),)),
            Grant(("xadd",), (_wo(_RECEIPTS), _wo(_DEAD))),
            Grant(
                ("exists", "hget", "hsetnx", "hset", "hexists", "hlen", "hmget", "hkeys"),
                (_rw(_GROUP_META), _rw(_GROUP_MEMBERS)),
            ),
            Grant(("zadd", "zrem", "zrangebyscore", "zcard"), (_rw(_OPEN_GROUPS),)),
        ),
    ),
    "trainer": RolePolicy(
        "trainer: consume receipts, claim each rollout (script: GET, SET, DEL claimed; EXISTS fence), read "
        "staged records (MGET), then delete them and their calls entries (script: DEL, TYPE, XRANGE, XDEL, "
        "XLEN) and retire the ledger (script: EXISTS, SET fence, DEL); read a ledger for an export by id (script: "
        "EXISTS, XRANGE); delete rollouts so their ids are reusable "
        "(``staging-sink delete``: DEL of every key under the rollout's hash tag, one key per DEL); dead-letter "
        "poison entries; GRPO groups: claim a group entry's group and read its members (script: EXISTS, HGET, "
        "HSET meta, HMGET members), close a consumed group (script: HGET, HSET, PEXPIRE); publish its weight "
        "version (SET weight_version, weight_version:last); "
        "ledger retirement, acknowledgements and dead letters confirmed durable in their round trip (WAITAOF, "
        "CONFIG GET)",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", "time", *_TRANSACTIONS, *_DURABLE_ACK)),
            Grant(
                _SCRIPTS,
                tuple(
                    _rw(p)
                    for p in (
                        _REC,
                        _CALLS,
                        _LEDGER,
                        _LEDGER_IDS,
                        _FENCE,
                        _CLAIMED,
                        _RECEIPT,
                        _RECEIPTS,
                        _GROUP_META,
                        _GROUP_MEMBERS,
                    )
                ),
            ),
            Grant(("exists", "hget", "hset", "hmget", "pexpire"), (_rw(_GROUP_META), _rw(_GROUP_MEMBERS))),
            Grant(_CONSUMER, (_rw(_RECEIPTS),)),
            Grant(("get", "del", "exists"), (_rw(_RECEIPT),)),
            Grant(("expire",), (_rw(_RECEIPT), _rw(_FENCE))),  # retention after ack (sink.trainer.reader.retention)
            Grant(("get", "set", "del", "exists"), (_rw(_CLAIMED),)),
            Grant(("get", "mget", "del"), (_rw(_REC),)),
            Grant(("type", "xrange", "xdel", "xlen", "del", "exists"), (_rw(_CALLS),)),
            Grant(("exists", "del"), (_rw(_LEDGER), _rw(_LEDGER_IDS))),
            Grant(("xrange",), (_ro(_LEDGER),)),  # an export by id builds a rollout's chain record from its ledger
            Grant(("exists", "set", "del"), (_rw(_FENCE),)),
            Grant(("xadd",), (_wo(_DEAD),)),
            Grant(("set",), tuple(_wo(p) for p in _WEIGHTS)),
        ),
    ),
    "ops": RolePolicy(
        "operators, the stats/inspect/tail/report/prune --dry-run CLI and the metrics exporter: read-only, no writes, "
        "no scripts; of the NeMo Gym transport's keys only what stats/inspect show (HGETALL gym, gym:digests and "
        "gym:frozen, HLEN gym:entries and gym:snapshot, SMEMBERS gym:intents, GET gym:tombstone)",
        (
            Grant(
                (
                    *CONNECTION_COMMANDS,
                    "info",
                    "config|get",
                    "dbsize",
                    "slowlog|get",
                    "slowlog|len",
                    "scan",
                    "type",
                    "exists",
                    "ttl",
                    "get",
                    "hget",
                    "mget",
                    "xlen",
                    "xrange",
                    "xrevrange",
                    "xread",
                    "xinfo|stream",
                    "xinfo|groups",
                    "xinfo|consumers",
                    "xpending",
                    "memory|usage",
                ),
                (_ro("<ns>:*"),),
            ),
            Grant(("hgetall",), (_ro(_GYM), _ro(_GYM_DIGESTS), _ro(_GYM_FROZEN))),
            Grant(("hlen",), (_ro(_GYM_ENTRIES), _ro(_GYM_SNAPSHOT))),
            Grant(("smembers",), (_ro(_GYM_INTENTS),)),
        ),
    ),
    "gym_sink": RolePolicy(
        "NeMo Gym model server (sink.gym.RedisTokenSink): put, mark_incomplete, begin_call through the gym script, "
        "on the open side of the Gym keys only: HGET, HSET, HSETNX, HINCRBY of its state (gym); HSET of "
        "gym:entries, write-only (it never reads an entry back); HGET, HSET gym:digests; SADD gym:intents, "
        "write-only; TYPE and EXISTS of every Gym key (a frozen or dropped rollout refuses writes). No key of the RL "
        "path, nothing of a frozen rollout's snapshot (gym:frozen, gym:snapshot) or tombstone but EXISTS. "
        "Verify durability (CONFIG GET, INFO), confirm writes (WAIT, WAITAOF)",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", "config|get", "info", "wait", "waitaof", "time")),
            Grant(_SCRIPTS, tuple(_rw(p) for p in _GYM_KEYS)),
            Grant(("type", "exists"), tuple(_ro(p) for p in _GYM_KEYS)),
            Grant(("hget", "hset", "hsetnx", "hincrby"), (_rw(_GYM),)),
            Grant(("hset",), (_wo(_GYM_ENTRIES),)),
            Grant(("hget", "hset"), (_rw(_GYM_DIGESTS),)),
            Grant(("sadd",), (_wo(_GYM_INTENTS),)),
        ),
    ),
    "gym_source": RolePolicy(
        "NeMo Gym consumer (sink.gym.RedisTokenSource): freeze through the gym script (HGET gym, SMEMBERS "
        "gym:intents, HEXISTS gym:digests; RENAME gym:entries to gym:snapshot; HGET, HSET, HINCRBY gym:frozen; then, "
        "in the same round trip, HVALS gym:snapshot, HGET gym:frozen, EXISTS gym:tombstone) and drop (GET, SET "
        "gym:tombstone; DEL of the other Gym keys, one key per DEL); TYPE and EXISTS of every Gym key. It writes "
        "nothing the sink owns (no entry, digest, intent or state field), lifts no tombstone, reaches no key of the "
        "RL path. Verify durability, confirm writes",
        (
            Grant((*CONNECTION_COMMANDS, "script|load", "config|get", "info", "wait", "waitaof", "time")),
            Grant(_SCRIPTS, tuple(_rw(p) for p in _GYM_KEYS)),
            Grant(("type", "exists"), tuple(_ro(p) for p in _GYM_KEYS)),
            Grant(("hget", "del"), (_rw(_GYM),)),
            Grant(("hexists",), (_ro(_GYM_DIGESTS),)),
            Grant(("smembers",), (_ro(_GYM_INTENTS),)),
            Grant(("del",), (_wo(_GYM_ENTRIES), _wo(_GYM_DIGESTS), _wo(_GYM_INTENTS))),
            Grant(("rename",), (_rw(_GYM_ENTRIES), _wo(_GYM_SNAPSHOT))),  # the first freeze: entries -> snapshot
            Grant(("hvals", "del"), (_rw(_GYM_SNAPSHOT),)),
            Grant(("hget", "hset", "hincrby", "del"), (_rw(_GYM_FROZEN),)),
            Grant(("get", "set"), (_rw(_GYM_TOMBSTONE),)),
        ),
    ),
    "replica": RolePolicy(
        "replication link only: the replicas' `masteruser` (PSYNC/SYNC, REPLCONF, PING). A leaked `masterauth` "
        "(which CONFIG GET shows the worker and ops roles) then lets its holder copy the dataset, but run no "
        "command on a key, no CONFIG and no script",
        (Grant(("ping", "auth", "hello", "psync", "sync", "replconf")),),
    ),
}
"""Role name -> policy: the one table that the ACL file, the docs and the tests are made from."""

ROLE_NAMES: tuple[str, ...] = tuple(ROLE_POLICIES)
ADMIN_ROLE = "admin"
"""Optional full-access user (``~* &* +@all``), rendered only when a password for it is given."""
