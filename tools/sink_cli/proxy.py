"""``staging-sink proxy`` and ``staging-sink engine``: the capture proxy and the simulated engine over HTTP.

Added to ``staging-sink`` by :func:`add_http_commands`. ``proxy --workers N`` runs N uvicorn
worker processes; each builds its app with :func:`app_from_environment` from the configuration the parent put in
``$STAGING_SINK_PROXY_CONFIG`` (all capture state is in Redis, so the workers need nothing else in common).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, get_args

from sink.settings import UpstreamKind
from sink_cli.common import EXIT_USAGE, CommandError
from sink_cli.context import CommandContext
from sink_cli.listen import check_listen
from sink_cli.logs import configure_logging
from worker.proxy.multiproc import multiprocess_directory

if TYPE_CHECKING:
    from sink.settings import ProxySettings
    from worker.proxy.app import ProxyApp

__all__ = (
    "CONFIG_ENV",
    "add_http_commands",
    "add_http_parsers",
    "app_from_environment",
    "engine_command",
    "proxy_command",
    "proxy_config",
)

CONFIG_ENV = "STAGING_SINK_PROXY_CONFIG"
LOGGING_ENV = "STAGING_SINK_PROXY_LOGGING"
"""The parent's -v / --log-format, as JSON, for the worker processes of ``proxy --workers N``."""
logger = logging.getLogger("worker.proxy")
_MIB = 1024 * 1024


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _require_extra() -> None:
    """:raises CommandError: uvicorn, httpx or orjson (the ``proxy`` extra) is not installed."""
    for module in ("uvicorn", "httpx", "orjson"):
        try:
            __import__(module)
        except ImportError:
            raise CommandError(
                f"{module} is missing: install the proxy extra (pip install -e '.[proxy]' in a clone)"
            ) from None


def add_http_commands(commands: Any, context: CommandContext) -> None:
    """Add ``proxy`` and ``engine`` to *commands* (the CLI's subparsers)."""
    add_http_parsers(commands, context.redis)


def add_http_parsers(commands: Any, redis_options: argparse.ArgumentParser) -> None:
    """Add the ``proxy`` and ``engine`` subcommands to *commands* (the CLI's subparsers)."""
    proxy = commands.add_parser(
        "proxy",
        parents=[redis_options],
        help="OpenAI-compatible capture proxy in front of an inference server",
        description="Serve /v1/chat/completions, /v1/completions and /v1/responses with capture; pass the rest "
        "through. The rollout id comes from /r/{rollout_id}/v1/... or the X-Staging-Rollout-Id header; "
        'POST /r/{rollout_id}/finished with {"reward": ...} ends a rollout.',
    )
    proxy.add_argument(
        "--gate-redis-url",
        default=os.environ.get("STAGING_SINK_GATE_REDIS_URL") or None,
        metavar="URL",
        help="URL for the capture ledger and finished events (ACL user gate; default: --redis-url; "
        "$STAGING_SINK_GATE_REDIS_URL)",
    )
    proxy.add_argument("--upstream", required=True, metavar="URL", help="the inference server, e.g. http://vllm:8000")
    proxy.add_argument(
        "--upstream-kind",
        choices=get_args(UpstreamKind),
        default="vllm",
        help="vllm: stock vLLM (>= 0.10.2) OpenAI server; nemo-rl: an engine honouring required_prefix_token_ids",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8100, help="listen port (default: %(default)s)")
    proxy.add_argument("--workers", type=_positive_int, default=1, help="uvicorn worker processes (default: 1)")
    proxy.add_argument("--fail-closed", action="store_true", help="answer 503 when a call cannot be captured")
    proxy.add_argument(
        "--chain-policy",
        choices=("single", "roots", "branches"),
        default="single",
        help="multi-chain rollouts: a call that extends no earlier call starts a new chain (roots; branches: also "
        "every leaf); a rollout may opt in with the header X-Staging-Chains (default: single)",
    )
    proxy.add_argument("--no-capture", action="store_true", help="bare forwarding proxy (benchmarks)")
    proxy.add_argument("--upstream-timeout-s", type=_positive_float, default=600.0, help="default: %(default)s")
    proxy.add_argument("--redis-timeout-s", type=_positive_float, default=5.0, help="default: %(default)s")
    proxy.add_argument(
        "--max-response-mib", type=_positive_int, default=64, help="larger responses are served uncaptured (64)"
    )
    proxy.add_argument("--weight-version", type=int, default=0, help="policy weight version stamped on calls (0)")
    proxy.add_argument(
        "--weight-source",
        choices=("fixed", "engine", "published"),
        default="fixed",
        help="fixed (default): --weight-version; engine: vLLM's weight_versions spans in exact-prefix mode (integer "
        "labels; 'default' is --weight-version); published: the trainer's key (staging-sink weights set N)",
    )
    proxy.add_argument(
        "--weight-staleness-s",
        type=_positive_float,
        default=1.0,
        help="with --weight-source published: re-read the trainer's version at most this often (default: 1.0)",
    )
    proxy.add_argument(
        "--prefix-mode",
        choices=("auto", "exact", "verify"),
        default="auto",
        help="auto (default): exact-prefix chat and completions calls where the engine serves vLLM 0.32's render/generate/derender "
        "routes (vllm --enable-scale-out), verify mode elsewhere; exact: refuse to start without them; verify: never",
    )
    proxy.add_argument(
        "--durability",
        choices=("fsync", "none"),
        default="fsync",
        help="fsync (default): refuse to stage on a server without appendfsync always",
    )
    proxy.add_argument(
        "--server-timing",
        action="store_true",
        help="add a Server-Timing header (engine, capture, total ms) to captured calls' responses (benchmarks)",
    )
    proxy.set_defaults(handler=proxy_command)
    engine = commands.add_parser(
        "engine",
        help="the simulated engine over HTTP with vLLM's response JSON (a test upstream for the proxy)",
    )
    engine.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    engine.add_argument("--port", type=int, default=8000, help="listen port (default: %(default)s)")
    engine.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    engine.add_argument("--shape", choices=("vllm", "nemo-gym"), default="vllm", help="response token-field shape")
    engine.add_argument("--honour-prefix", action="store_true", help="honour required_prefix_token_ids (nemo-rl)")
    engine.add_argument("--drift", action="store_true", help="re-tokenize earlier assistant text differently")
    engine.add_argument(
        "--reasoning-field",
        choices=("reasoning", "reasoning_content"),
        help="put half of each chat reply in this message field (a reasoning parser's output)",
    )
    engine.add_argument("--tool-calls", action="store_true", help="answer a chat request naming tools with a call")
    engine.add_argument(
        "--routed-experts",
        choices=("choice", "message"),
        help="add routed_experts to chat replies: on the choice as base64 .npy (vLLM 0.32) or on the message",
    )
    engine.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve vLLM 0.32's token-in/token-out routes (render, generate, derender), as vllm --enable-scale-out",
    )
    engine.set_defaults(handler=engine_command)


def proxy_config(args: argparse.Namespace) -> ProxySettings:
    """The :class:`ProxySettings` of parsed ``proxy`` arguments.

    :raises CommandError: capture is on but no Redis URL was given, or the ``proxy`` extra is missing.
    """
    _require_extra()
    from sink.settings import ProxySettings

    capture = not args.no_capture
    if capture and not args.redis_url:
        raise CommandError("the capture proxy needs --redis-url (or $STAGING_SINK_REDIS_URL)", exit_code=EXIT_USAGE)
    return ProxySettings(
        upstream_url=args.upstream,
        redis_url=args.redis_url or "",
        gate_redis_url=args.gate_redis_url or "",
        namespace=args.namespace,
        cluster=args.cluster,
        upstream_kind=args.upstream_kind,
        capture=capture,
        fail_closed=args.fail_closed,
        chain_policy=args.chain_policy,
        upstream_timeout_s=args.upstream_timeout_s,
        max_response_bytes=args.max_response_mib * _MIB,
        weight_version=args.weight_version,
        weight_source=args.weight_source,
        weight_staleness_s=args.weight_staleness_s,
        prefix_mode=args.prefix_mode,
        durability=args.durability,
        redis_timeout_s=args.redis_timeout_s,
        server_timing=args.server_timing,
    )


def app_from_environment() -> ProxyApp:
    """The proxy app of ``$STAGING_SINK_PROXY_CONFIG`` (uvicorn's factory in each worker process)."""

    from sink.settings import ProxySettings
    from worker.proxy.app import ProxyApp

    fields = os.environ[CONFIG_ENV]
    logging_options = json.loads(os.environ.get(LOGGING_ENV) or "{}")
    configure_logging(
        verbose=bool(logging_options.get("verbose")), log_format=str(logging_options.get("log_format") or "text")
    )
    _tune_gc()
    _say_the_prefix_mode()
    config = ProxySettings.model_validate_json(fields)
    logger.info("proxy worker %d serving -> %s", os.getpid(), config.upstream_url)
    return ProxyApp(config)


def _tune_gc() -> None:
    """Serve-process garbage-collector settings: engine responses parse into thousands of small containers per
    call (one per log-prob entry), which would trigger a young-generation collection every 700 allocations and
    full collections over every long-lived object; freeze the startup heap and collect the young generation less
    often. Only the command's own process is tuned (the library never touches the collector)."""
    if os.environ.get("STAGING_SINK_DEFAULT_GC") == "1":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


_MODE_LOGGERS = ("worker.proxy.exact.mode", "worker.proxy.app")
"""Where the proxy says, once at start, which prefix mode it uses and why."""


def _say_the_prefix_mode() -> None:
    """The prefix-mode line at start is printed without ``-v`` too (the rest of INFO stays behind it)."""
    for name in _MODE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


def _refuse_before_serving(config: ProxySettings) -> None:
    """Open the proxy once (Redis, the engine's probe) before serving, so a configuration the engine cannot honour
    (``--prefix-mode exact`` or ``--weight-source engine`` without its token-in/token-out routes) is one usage line,
    not a server start that fails.

    :raises CommandError: the configuration is refused (:data:`EXIT_USAGE`).
    """
    import anyio

    from worker.errors import StagingModeError
    from worker.proxy.app import ProxyApp

    async def open_once() -> None:
        app = ProxyApp(config)
        await app.open()
        await app.aclose()

    try:
        anyio.run(open_once)
    except StagingModeError as exc:
        raise CommandError(str(exc), exit_code=EXIT_USAGE) from exc


def proxy_command(args: argparse.Namespace) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM."""
    config = proxy_config(args)
    check_listen(args.host, args.port)
    import uvicorn

    from worker.proxy.app import ProxyApp

    _tune_gc()
    sys.stderr.write(
        f"capture proxy on http://{args.host}:{args.port} -> {config.upstream_url} ({config.upstream_kind}, "
        f"{'capture' if config.capture else 'no capture'}, {'fail-closed' if config.fail_closed else 'fail-open'})\n"
    )
    if config.capture and (config.prefix_mode == "exact" or config.weight_source == "engine"):
        _refuse_before_serving(config)
    _say_the_prefix_mode()
    # log_config=None: uvicorn's own lines go through the CLI's handler (timestamps, levels, --log-format).
    if args.workers == 1:
        uvicorn.run(
            ProxyApp(config), host=args.host, port=args.port, log_level="warning", access_log=False, log_config=None
        )
        return 0
    os.environ[CONFIG_ENV] = config.model_dump_json()
    # The workers are fresh processes: they configure logging from the parent's options, and write their
    # metrics to one fresh multiprocess directory, so any worker answers a scrape for all of them.
    os.environ[LOGGING_ENV] = json.dumps(
        {"verbose": bool(getattr(args, "verbose", False)), "log_format": getattr(args, "log_format", "text")}
    )
    with multiprocess_directory():
        uvicorn.run(
            "sink_cli.proxy:app_from_environment",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="warning",
            access_log=False,
            log_config=None,
        )
    return 0


def engine_command(args: argparse.Namespace) -> int:
    """Run the simulated HTTP engine in the foreground until SIGINT/SIGTERM."""
    _require_extra()
    check_listen(args.host, args.port)
    import uvicorn

    from sink_tools.simulated.http_app import EngineApp
    from sink_tools.simulated.options import EngineOptions

    _tune_gc()
    options = EngineOptions(
        seed=args.seed,
        shape=args.shape,
        honour_prefix=args.honour_prefix,
        drift=args.drift,
        scale_out=args.enable_scale_out,
        reasoning_field=args.reasoning_field,
        tool_calls=args.tool_calls,
        routed_experts=args.routed_experts,
    )
    sys.stderr.write(f"simulated engine on http://{args.host}:{args.port} ({options})\n")
    uvicorn.run(EngineApp(options), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
