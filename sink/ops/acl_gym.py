"""The NeMo Gym transport's ACL roles (:mod:`sink.gym`), merged into :data:`sink.ops.acl.ROLE_POLICIES`."""

from __future__ import annotations

from collections.abc import Mapping

from sink.ops.acl_grants import (
    CONNECTION_COMMANDS,
    FENCE_PATTERN,
    SCRIPT_COMMANDS,
    Grant,
    RolePolicy,
    read_only,
    read_write,
)

__all__ = ("GYM_ROLE_POLICIES",)

_GYM = "<ns>:{*}:gym"
_GYM_ENTRIES = "<ns>:{*}:gym:entries"
_GYM_DIGESTS = "<ns>:{*}:gym:digests"
_GYM_INTENTS = "<ns>:{*}:gym:intents"
_GYM_KEYS = (_GYM, _GYM_ENTRIES, _GYM_DIGESTS, _GYM_INTENTS, FENCE_PATTERN)
_ROOT = (*CONNECTION_COMMANDS, "script|load", "config|get", "info", "wait", "waitaof", "time")

GYM_ROLE_POLICIES: Mapping[str, RolePolicy] = {
    "gym_sink": RolePolicy(
        "NeMo Gym model server (sink.gym.RedisTokenSink): put, mark_incomplete, begin_call through the gym script "
        "(TYPE, TIME, HGET, HSET, HSETNX, HINCRBY on gym, gym:entries, gym:digests; SADD gym:intents; EXISTS fence: "
        "a dropped rollout refuses late writes), verify durability (CONFIG GET, INFO), confirm writes (WAIT, WAITAOF)",
        (
            Grant(_ROOT),
            Grant(SCRIPT_COMMANDS, tuple(read_write(p) for p in _GYM_KEYS)),
            Grant(("type", "hget", "hset", "hsetnx", "hincrby"), (read_write(_GYM),)),
            Grant(("type", "hget", "hset"), (read_write(_GYM_ENTRIES), read_write(_GYM_DIGESTS))),
            Grant(("type", "sadd"), (read_write(_GYM_INTENTS),)),
            Grant(("type", "exists"), (read_only(FENCE_PATTERN),)),
        ),
    ),
    "gym_source": RolePolicy(
        "NeMo Gym consumer (sink.gym.RedisTokenSource): freeze (gym script: TYPE, TIME, HGET, HSET, HSETNX, HINCRBY "
        "gym; HVALS gym:entries; HEXISTS gym:digests; SMEMBERS gym:intents; EXISTS fence) and drop (GET, SET fence "
        "as the tombstone; DEL of the gym keys, one key per DEL), verify durability, confirm writes",
        (
            Grant(_ROOT),
            Grant(SCRIPT_COMMANDS, tuple(read_write(p) for p in _GYM_KEYS)),
            Grant(("type", "hget", "hset", "hsetnx", "hincrby", "del"), (read_write(_GYM),)),
            Grant(("type", "hvals", "del"), (read_write(_GYM_ENTRIES),)),
            Grant(("type", "hexists", "del"), (read_write(_GYM_DIGESTS),)),
            Grant(("type", "smembers", "del"), (read_write(_GYM_INTENTS),)),
            Grant(("type", "exists", "get", "set"), (read_write(FENCE_PATTERN),)),
        ),
    ),
}
"""``gym_sink`` (the model servers' ``RedisTokenSink``) and ``gym_source`` (the consumer's ``RedisTokenSource``)."""
