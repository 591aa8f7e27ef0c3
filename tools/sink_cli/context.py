"""What every command's parser shares: the environment variables its defaults come from and the Redis options
(``--redis-url``, ``--namespace``, ``--cluster``), handed to each command module as a :class:`CommandContext`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from sink.keys import DEFAULT_NAMESPACE
from sink_cli.cluster_flag import CLUSTER_HELP
from sink_cli.common import namespace_name

__all__ = ("ENV_GATE_REDIS_URL", "ENV_NAMESPACE", "ENV_REDIS_URL", "CommandContext", "redis_options")

ENV_REDIS_URL = "STAGING_SINK_REDIS_URL"
ENV_GATE_REDIS_URL = "STAGING_SINK_GATE_REDIS_URL"
ENV_NAMESPACE = "STAGING_SINK_NAMESPACE"


def redis_options(
    env: Mapping[str, str],
    *,
    url_help: str,
    namespace_default: str | None = DEFAULT_NAMESPACE,
    namespace_help: str | None = None,
) -> argparse.ArgumentParser:
    """A parent parser with ``--redis-url``, ``--namespace`` and ``--cluster``, defaults from *env*."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("Redis")
    group.add_argument("--redis-url", default=env.get(ENV_REDIS_URL) or None, metavar="URL", help=url_help)
    group.add_argument(
        "--namespace",
        default=env.get(ENV_NAMESPACE) or namespace_default,
        type=namespace_name,
        metavar="NS",
        help=namespace_help or f"key namespace (default: ${ENV_NAMESPACE} or {DEFAULT_NAMESPACE!r})",
    )
    group.add_argument("--cluster", action=argparse.BooleanOptionalAction, default=None, help=CLUSTER_HELP)
    return parent


@dataclass(frozen=True, slots=True)
class CommandContext:
    """What a command module gets: the environment the defaults come from, and the shared Redis options."""

    env: Mapping[str, str]
    redis: argparse.ArgumentParser
    """The parent parser of every command that talks to Redis (``--redis-url``, ``--namespace``, ``--cluster``)."""

    def redis_options(
        self, *, url_help: str, namespace_default: str | None = DEFAULT_NAMESPACE, namespace_help: str | None = None
    ) -> argparse.ArgumentParser:
        """Redis options with other help texts or namespace default (see :func:`redis_options`)."""
        return redis_options(
            self.env, url_help=url_help, namespace_default=namespace_default, namespace_help=namespace_help
        )
