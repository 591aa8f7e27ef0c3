"""``staging-sink report [ROLLOUT...] --html out.html`` (and ``inspect R --html``): a look at what was staged.

Reads with plain read-only commands (SCAN, TYPE, XRANGE, GET, MGET: the ``ops`` ACL user can run them), builds
the views of :mod:`sink_tools.report_html` and writes one self-contained page. Without rollout ids, a sample of
the namespace's rollouts (the most recently staged first). Nothing is changed on the server.
"""

from __future__ import annotations

import argparse
import datetime
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import anyio

from sink.contract.records import RolloutReceipt, StagedCallSnapshot
from sink.contract.skip_codes import SkipCode
from sink.errors import CodecError, ReceiptVerificationError
from sink.keys import calls_stream
from sink.settings import SourceSettings
from sink.store.connection import Topology, map_redis_errors, reply_text
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.verify import verify_and_linearize
from sink_cli.common import (
    EXIT_OK,
    CommandError,
    RedisTarget,
    open_topology,
    positive_int,
    stderr_console,
)
from sink_cli.listing import collect_rollouts
from sink_cli.rollouts import checked_rollout_id, no_such_rollout, rollout_state
from sink_tools.report_html import CallView, RolloutView, SummaryView, render_report

__all__ = ("add_report_commands", "write_report")

DEFAULT_SAMPLE = 5
_NOTE = (
    "States as staging-sink list reports them. Skip reasons: published receipts the trainer skips "
    "(rollout_failed, capture_poisoned), plus the verification codes of the rollouts shown below."
)


def add_report_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    redis: argparse.ArgumentParser,
    inspect: argparse.ArgumentParser,
    target: Callable[[argparse.Namespace], RedisTarget],
) -> None:
    """Register ``report`` on *commands* and ``--html PATH`` on the ``inspect`` parser *inspect*."""
    command = commands.add_parser(
        "report",
        parents=[redis],
        help="write a self-contained HTML page: namespace summary; per call tokens, mask, log-probs, chain links",
    )
    command.add_argument("rollout_ids", metavar="ROLLOUT", nargs="*", help="rollouts to show (default: a sample)")
    command.add_argument("--html", metavar="PATH", required=True, help="the page to write")
    command.add_argument(
        "--sample",
        type=positive_int,
        default=DEFAULT_SAMPLE,
        metavar="N",
        help="without ROLLOUT ids: show the N most recently staged rollouts",
    )
    command.set_defaults(handler=lambda a: _run(target(a), a.rollout_ids, a.html, a.sample))
    inspect.add_argument("--html", metavar="PATH", help="write the rollout's HTML page (as `report R`) instead")
    text_handler = inspect.get_default("handler")
    inspect.set_defaults(
        handler=lambda a: _run(target(a), [a.rollout_id], a.html, 1) if a.html else text_handler(a)
    )


def _run(target: RedisTarget, rollout_ids: Sequence[str], output: str, sample: int) -> int:
    return anyio.run(partial(write_report, target, rollout_ids, output=output, sample=sample))


def _skip_code(receipt: RolloutReceipt | None) -> SkipCode | None:
    """The code the trainer skips a published receipt with, or ``None`` (trainable or no receipt)."""
    if receipt is None:
        return None
    if receipt.failure_reason is not None:
        return SkipCode.ROLLOUT_FAILED
    return SkipCode.CAPTURE_POISONED if receipt.capture_poisoned else None


async def _summary(topology: Topology, target: RedisTarget) -> tuple[SummaryView, list[str], dict[str, str]]:
    """The namespace summary (states as ``staging-sink list`` names them), and the rollouts with calls, most
    recently staged first."""
    ns = target.namespace
    rollouts = [r for r in await collect_rollouts(topology, ns) if ":" not in r.rollout_id]  # not {grp:...}
    per_minute: Counter[str] = Counter()
    newest: dict[str, int] = {}
    with map_redis_errors("read the calls streams"):
        for rollout in rollouts:
            if "calls" not in rollout.keys:
                continue
            stream = calls_stream(ns, rollout.rollout_id)
            for raw_id, raw_fields in await topology.node_for_key(stream).xrange(stream) or []:
                millis = int(reply_text(raw_id, lenient=True).split("-")[0])
                minute = datetime.datetime.fromtimestamp(millis / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M")
                fields = {
                    reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (raw_fields or {}).items()
                }
                per_minute[minute] += int(fields.get("delta_len") or 0)
                newest[rollout.rollout_id] = max(newest.get(rollout.rollout_id, 0), millis)
    codes = (_skip_code(r.receipt) for r in rollouts if r.state != "consumed")
    skips: Counter[str] = Counter(code for code in codes if code)
    summary = SummaryView(
        namespace=ns,
        server=target.display_url,
        generated_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        rollouts_by_state=dict(Counter(r.state for r in rollouts)),
        tokens_per_minute=sorted(per_minute.items()),
        skip_reasons=dict(skips),
        notes=(_NOTE,),
    )
    recent = sorted(newest, key=lambda r: (-newest[r], r))
    return summary, recent, {r.rollout_id: r.state for r in rollouts}


async def _calls(source: AsyncRedisStagingSource, keys: Sequence[str]) -> list[CallView]:
    views: list[CallView] = []
    cum_by_call: dict[str, int] = {}
    for key in keys:
        try:
            (record,) = await source.fetch([key])
        except KeyError:
            continue  # shown as missing by the rollout's verification
        except CodecError as exc:
            views.append(_broken(key, f"corrupt: {exc}"))
            continue
        views.append(_view(record, cum_by_call))
        cum_by_call[record.model_call_id] = record.cum_len
    return views


def _broken(key: str, status: str) -> CallView:
    return CallView(key, None, 0, 0, 0, "", (), (), (), "unknown", status)


def _view(record: StagedCallSnapshot, cum_by_call: dict[str, int]) -> CallView:
    parent = record.parent_call_id
    if parent is None:
        link = "root" if record.prev_len == 0 else f"root with prev_len {record.prev_len}"
    elif parent not in cum_by_call:
        link = f"parent {parent} not staged before it"
    else:
        link = "ok" if record.prev_len == cum_by_call[parent] else f"prev_len {record.prev_len} != parent cum_len"
    return CallView(
        model_call_id=record.model_call_id,
        parent_call_id=parent,
        prev_len=record.prev_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        token_ids=record.token_ids_delta,
        token_mask=record.token_mask_delta,
        logprobs=record.generation_log_probs_delta,
        link=link,
        status="digest ok",
    )


async def _rollout_view(
    topology: Topology, target: RedisTarget, rollout_id: str, skips: Counter[str], state_of: dict[str, str]
) -> RolloutView:
    state: dict[str, Any] = await rollout_state(topology, target, rollout_id)
    if not state["exists"]:
        raise no_such_rollout(rollout_id, target)
    receipt: RolloutReceipt | None = state["receipt"]
    keys = [fields["key"] for _, fields in state["calls"] if fields.get("key")]
    settings = SourceSettings(namespace=target.namespace, cluster=target.cluster)
    async with AsyncRedisStagingSource(topology.client, settings) as source:
        calls = await _calls(source, keys)
        verification = "no receipt"
        if receipt is not None:
            try:
                snapshots = await source.fetch([row.staging_key for row in receipt.manifest])
                verify_and_linearize(receipt, snapshots)
                verification = "verified"
            except KeyError:
                verification = "consumed" if state["fenced"] else "not verified: missing_record"
            except CodecError as exc:
                verification = f"not verified: corrupt_record: {exc}"
            except ReceiptVerificationError as exc:
                verification = f"not verified: {exc.code}: {exc.detail}"
    if verification.startswith("not verified: "):
        skips[verification.split(": ")[1]] += 1
    return RolloutView(
        rollout_id=rollout_id,
        state=state_of.get(rollout_id, "unknown"),
        verification=verification,
        reward=None if receipt is None else receipt.reward,
        terminal_call_id=None if receipt is None else receipt.terminal_model_call_id,
        calls=calls,
    )


async def write_report(target: RedisTarget, rollout_ids: Sequence[str], *, output: str, sample: int) -> int:
    """Write the HTML report of *rollout_ids* (or a sample of *sample* rollouts) to *output*.

    :raises CommandError: (exit 1) a named rollout does not exist or *output* cannot be written; (exit 2) an
        invalid rollout id.
    """
    for rollout_id in rollout_ids:
        checked_rollout_id(rollout_id)
    async with open_topology(target) as topology:
        summary, recent, state_of = await _summary(topology, target)
        chosen = list(dict.fromkeys(rollout_ids)) or recent[:sample]
        skips: Counter[str] = Counter(summary.skip_reasons)
        views = [await _rollout_view(topology, target, rollout_id, skips, state_of) for rollout_id in chosen]
    page = render_report(replace(summary, skip_reasons=dict(skips)), views)
    try:
        await anyio.Path(output).write_text(page, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write the report to {output!r}: {exc.strerror or exc}") from exc
    stderr_console().print(f"wrote the report of {len(views)} rollout(s) in namespace {target.namespace} to {output}")
    return EXIT_OK
