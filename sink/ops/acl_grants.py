"""The vocabulary of the ACL role table (:mod:`sink.ops.acl`): key patterns, grants, role policies, and the
commands and patterns every role table shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = (
    "CONNECTION_COMMANDS",
    "FENCE_PATTERN",
    "SCRIPT_COMMANDS",
    "Access",
    "Grant",
    "KeyPattern",
    "RolePolicy",
    "read_only",
    "read_write",
    "write_only",
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


def read_write(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "RW")


def read_only(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "R")


def write_only(pattern: str) -> KeyPattern:
    return KeyPattern(pattern, "W")


FENCE_PATTERN = "<ns>:{*}:fence"
"""A rollout's retire fence (also the NeMo Gym transport's tombstone)."""

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

SCRIPT_COMMANDS = ("fcall", "fcall_ro", "evalsha", "eval")
"""Running the package's scripts: ``FCALL`` of the loaded function library on Redis >= 7.0 and Valkey,
``EVALSHA``/``EVAL`` only on Redis 6.2 (see :data:`COMMANDS_UNTIL`)."""
