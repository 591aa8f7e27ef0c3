"""A durable server that loads a generated ACL file, with a client per role."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sink.ops.access.render import ADMIN_ROLE, ROLE_NAMES, generate_passwords, render_acl_file
from sink.server import DurableServer
from sink.store.scripts import LIBRARY

ACL_DENIAL = re.compile(r"NOPERM|no permissions|ACL failure|user executing the script can't (run|access)")


def is_acl_denial(exc: BaseException) -> bool:
    """NOPERM, or the same refusal reported from inside a script (Valkey: "ACL failure in script", Redis 7.0:
    "The user executing the script can't run this command" or "... can't access at least one of the keys")."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.ResponseError) and ACL_DENIAL.search(str(exc)) is not None
    )


class AclServer(DurableServer):
    """A durable server that loads an ACL file; its own client (readiness, SHUTDOWN, test setup) is admin."""

    def __init__(self, *, passwords: dict[str, str], **kwargs: Any) -> None:
        self.passwords = passwords
        super().__init__(**kwargs)

    def client(self, *, timeout_s: float = 5.0) -> redis.Redis:
        return self.role_client(ADMIN_ROLE, timeout_s=timeout_s)

    def role_client(self, role: str, *, password: str | None = None, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis(
            host=self.host,
            port=self.port,
            username=role,
            password=self.passwords[role] if password is None else password,
            socket_timeout=timeout_s,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )

    def role_url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@{self.host}:{self.port}"


def start_acl_server(binary: str | Path, directory: Path, *, setup: bool = True, **render: Any) -> AclServer:
    """A server loading a freshly generated ACL file; with *setup*, the admin loads the function library
    (what ``staging-sink setup`` does) where the server has functions."""
    passwords = generate_passwords((*ROLE_NAMES, ADMIN_ROLE))
    acl_path = directory / "users.acl"
    server = AclServer(passwords=passwords, binary=binary, data_dir=directory, extra_config={"aclfile": str(acl_path)})
    acl_path.write_text(render_acl_file(passwords=passwords, server_version=server.version, **render))
    server.start()
    if setup and _version(server.version) >= (7, 0):
        with server.client() as admin:
            admin.function_load(LIBRARY.source, replace=True)
    return server


def _version(text: str) -> tuple[int, int]:
    major, minor, *_rest = text.split(".")
    return int(major), int(minor)
