"""Operator commands that read single rollouts: ``inspect``, ``verify`` and ``tail``.

Each command is an async function returning its exit code; :mod:`sink_cli.dispatch` parses the arguments and
runs it.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
from rich.table import Table

from sink.contract.chains import ChainPolicy, RolloutChains
from sink.contract.records import RolloutManifest, RolloutReceipt, StagedCallSnapshot
from sink.contract.skip_codes import SkipCode
from sink.errors import CodecError, ReceiptVerificationError
from sink.keys import calls_stream, fence_key, ledger_stream, receipt_key, validate_rollout_id
from sink.ledger.ownership import ownership_problem
from sink.ledger.rows import chain_view_from_entries, manifest_from_entries
from sink.rollout.chains import build_chains
from sink.rollout.receipt import build_receipt
from sink.settings import SourceSettings
from sink.store.connection import Topology, map_redis_errors, reply_text
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.pulled import chain_receipt
from sink.trainer.verify import verify_and_linearize
from sink_cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    cancel_on_signal,
    open_topology,
    stderr_console,
    stdout_console,
)
from sink_cli.common import write_json as _write_json
from sink_cli.gym_view import gym_rollout_state, render_gym_state

__all__ = (
    "checked_rollout_id",
    "inspect_rollout",
    "no_such_rollout",
    "rollout_state",
    "tail_rollout",
    "verify_rollout",
)

_TAIL_BLOCK_MS = 1000


def checked_rollout_id(rollout_id: str) -> str:
    """*rollout_id* if valid.

    :raises CommandError: (exit 2) it is not a valid rollout id.
    """
    try:
        return validate_rollout_id(rollout_id)
    except ValueError as exc:
        raise CommandError(
            f"{exc}: rollout ids are ASCII letters, digits, '.', '_' and '-'", exit_code=EXIT_USAGE
        ) from exc


def _entry(raw: Any) -> tuple[str, dict[str, str]]:
    entry_id, fields = raw
    return reply_text(entry_id, lenient=True), {
        reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in fields.items()
    }


# --- inspect -----------------------------------------------------------------------------------------


async def rollout_state(topology: Topology, target: RedisTarget, rollout_id: str) -> dict[str, Any]:
    """Everything stored about one rollout, read with plain read-only commands (the ``ops`` ACL user can run
    them: XRANGE, TYPE, GET, and the NeMo Gym transport's hash reads). Not one atomic snapshot: an inspection
    tool, not a trainer."""
    ns = target.namespace
    client = topology.client
    with map_redis_errors(f"read rollout {rollout_id!r}"):
        calls = [_entry(raw) for raw in await client.xrange(calls_stream(ns, rollout_id)) or []]
        fenced = reply_text(await client.type(fence_key(ns, rollout_id)), lenient=True) != "none"
        ledger_entries = [_entry(raw)[1] for raw in await client.xrange(ledger_stream(ns, rollout_id)) or []]
        receipt_text = await client.get(receipt_key(ns, rollout_id))
        gym = await gym_rollout_state(topology, ns, rollout_id)
    # A retired rollout has no ledger left (retire removes it with the fence set in one script).
    manifest = None if fenced else manifest_from_entries(rollout_id, ledger_entries)
    receipt = None
    if receipt_text is not None:
        try:
            receipt = RolloutReceipt.model_validate_json(receipt_text)
        except ValueError as exc:
            raise CommandError(f"the stored receipt of {rollout_id!r} is corrupt: {exc}") from exc
    exists = bool(calls) or fenced or receipt is not None or gym is not None
    exists = exists or (manifest is not None and bool(manifest.records or manifest.failures))
    chains = None if manifest is None else _live_chains(rollout_id, manifest, receipt, ledger_entries)
    return {"calls": calls, "fenced": fenced, "manifest": manifest, "receipt": receipt, "gym": gym, "exists": exists} | {
        "chains": chains
    }


def _live_chains(
    rollout_id: str, manifest: RolloutManifest, receipt: RolloutReceipt | None, entries: list[dict[str, str]]
) -> RolloutChains | None:
    """A multi-chain rollout's chain record (§14.3), from its live ledger and its receipt (or a heuristic one)."""
    view = chain_view_from_entries(entries)
    if view.policy is ChainPolicy.SINGLE:
        return None
    try:
        return build_chains(receipt or build_receipt(manifest, rollout_id=rollout_id, reward=None), manifest, view)
    except ValueError:
        return None  # a manifest no receipt can be built from: inspect shows it row by row


_INT_FIELDS = frozenset(("prev_len", "delta_len", "cum_len", "weight", "bytes"))


def _typed(fields: dict[str, str]) -> dict[str, str | int]:
    """A calls-stream entry's fields with its counts as numbers (stream fields are stored as text)."""
    return {k: int(v) if k in _INT_FIELDS and v.isdigit() else v for k, v in fields.items()}


def no_such_rollout(rollout_id: str, target: RedisTarget) -> CommandError:
    return CommandError(
        f"no such rollout {rollout_id!r} in namespace {target.namespace!r} at {target.display_url} "
        "(no calls, ledger, fence, receipt or gym transport keys)"
    )


async def inspect_rollout(target: RedisTarget, rollout_id: str, *, as_json: bool) -> int:
    """``staging-sink inspect R``: the rollout's calls stream, ledger manifest, fence and receipt, and its NeMo
    Gym transport state when it has one.

    :raises CommandError: (exit 1) the rollout does not exist; (exit 2) the id is invalid.
    """
    checked_rollout_id(rollout_id)
    async with open_topology(target) as topology:
        state = await rollout_state(topology, target, rollout_id)
    if not state["exists"]:
        raise no_such_rollout(rollout_id, target)
    manifest: RolloutManifest | None = state["manifest"]
    receipt: RolloutReceipt | None = state["receipt"]
    if as_json:
        _write_json(
            {
                "rollout_id": rollout_id,
                "calls": [{"entry_id": entry_id, **_typed(fields)} for entry_id, fields in state["calls"]],
                "retired": state["fenced"],
                "manifest": None if manifest is None else manifest.model_dump(mode="json"),
                "receipt": None if receipt is None else receipt.model_dump(mode="json"),
                "gym": state["gym"],
                "chains": None if state["chains"] is None else state["chains"].model_dump(mode="json"),
            }
        )
        return EXIT_OK
    console = stdout_console()
    console.print(f"[bold]rollout {rollout_id}[/] (namespace {target.namespace}, {target.display_url})")
    console.print(f"ledger: {'retired (fenced)' if state['fenced'] else 'live'}")
    if state["gym"] is not None:
        render_gym_state(console, state["gym"])
    calls = Table(title=f"calls stream: {len(state['calls'])} staged record(s)", title_justify="left")
    for column in ("entry id", "call", "parent", "prev", "delta", "cum", "weight", "bytes", "digest"):
        calls.add_column(column, justify="right" if column in ("prev", "delta", "cum", "weight", "bytes") else "left")
    for entry_id, fields in state["calls"]:
        calls.add_row(
            entry_id,
            fields.get("call", ""),
            fields.get("parent") or "-",
            *(fields.get(name, "") for name in ("prev_len", "delta_len", "cum_len", "weight", "bytes")),
            fields.get("digest", "")[:12],
        )
    console.print(calls)
    if manifest is not None:
        rows = Table(title=f"ledger manifest: {len(manifest.records)} row(s)", title_justify="left")
        for column in ("call", "parent", "mode", "cum", "weight", "response id", "staging key"):
            rows.add_column(column)
        for record in manifest.records:
            rows.add_row(
                record.model_call_id,
                record.parent_call_id or "-",
                record.mode,
                str(record.cum_len),
                str(record.weight_version),
                record.response_id,
                record.staging_key,
            )
        console.print(rows)
        for failure in manifest.failures:
            console.print(f"[red]failure row[/]: call {failure.model_call_id}: {failure.reason}")
    chains: RolloutChains | None = state["chains"]
    if chains is not None:
        console.print(f"chains ({chains.policy}): {len(chains.chains)}, rollout failure {chains.failure_reason or '-'}")
        for chain in chains.chains:
            console.print(
                f"  chain {chain.index}: root {chain.root_call_id}, terminal {chain.terminal_call_id or '-'} "
                f"({chain.selection}), {len(chain.call_ids)} call(s), failure {chain.failure_reason or '-'}"
            )
    if receipt is None:
        console.print("receipt: none yet")
    else:
        state_text = "[red]poisoned[/]" if receipt.capture_poisoned else "[green]trainable[/]"
        console.print(
            f"receipt: {state_text}, terminal {receipt.terminal_model_call_id or '-'} "
            f"({receipt.terminal_selection or 'no selection'}), {len(receipt.manifest)} row(s), "
            f"reward {receipt.reward}, failure_reason {receipt.failure_reason or '-'}"
        )
    return EXIT_OK


# --- verify ------------------------------------------------------------------------------------------


def _verify_chains(
    receipt: RolloutReceipt, chains: RolloutChains, snapshots: list[StagedCallSnapshot]
) -> list[dict[str, Any]]:
    """Each chain verified on its own (§14.4): ``{index, root, verified, code, detail, tokens}``."""
    by_id = {snapshot.model_call_id: snapshot for snapshot in snapshots}
    results: list[dict[str, Any]] = []
    for chain in chains.chains:
        result: dict[str, Any] = {"index": chain.index, "root": chain.root_call_id, "terminal": chain.terminal_call_id}
        if chain.failure_reason is not None:
            results.append(result | {"verified": False, "code": SkipCode.ROLLOUT_FAILED, "detail": chain.failure_reason})
            continue
        try:
            row = verify_and_linearize(chain_receipt(receipt, chain), [by_id[c] for c in chain.tree_call_ids])
        except ReceiptVerificationError as exc:
            results.append(result | {"verified": False, "code": exc.code, "detail": exc.detail})
        else:
            results.append(result | {"verified": True, "tokens": len(row.token_ids)})
    return results


def _first_trainable(receipt: RolloutReceipt, chains: RolloutChains, results: list[dict[str, Any]]) -> RolloutReceipt:
    """The receipt the rollout-level summary verifies: the first verified chain's (else the first chain's)."""
    chosen = next((r["index"] for r in results if r["verified"]), None)
    if chosen is None:
        first = results[0] if results else {"code": SkipCode.ROLLOUT_FAILED, "detail": chains.failure_reason or "no chains"}
        raise ReceiptVerificationError(first["code"], first["detail"])
    return chain_receipt(receipt, chains.chains[chosen])


async def verify_rollout(target: RedisTarget, rollout_id: str, *, as_json: bool) -> int:
    """``staging-sink verify R``: fetch the receipt (or build one from the live manifest), fetch the staged
    records and run ``verify_and_linearize``. Exit 0 if the rollout verifies, or if it was consumed: a
    trainer acknowledged it (receipt and retire fence present, staged records gone), so there is nothing left
    to verify and nothing wrong; exit 1 otherwise.

    :raises CommandError: (exit 1) no such rollout, or retired without a receipt.
    """
    checked_rollout_id(rollout_id)
    async with open_topology(target) as topology:
        state = await rollout_state(topology, target, rollout_id)
        receipt: RolloutReceipt | None = state["receipt"]
        source_of_receipt = "stored receipt"
        if receipt is None:
            manifest: RolloutManifest | None = state["manifest"]
            if manifest is None or not (manifest.records or manifest.failures):
                if state["fenced"]:
                    raise CommandError(f"rollout {rollout_id!r} is retired and has no receipt: nothing to verify")
                if state["calls"]:
                    raise CommandError(
                        f"rollout {rollout_id!r} has {len(state['calls'])} staged record(s) but no ledger rows and "
                        "no receipt: nothing to verify them against"
                    )
                raise no_such_rollout(rollout_id, target)
            receipt = build_receipt(manifest, rollout_id=rollout_id, reward=None)
            source_of_receipt = "receipt built from the live manifest (heuristic terminal)"
        outcome: dict[str, Any] = {"rollout_id": rollout_id, "receipt_source": source_of_receipt, "consumed": False}
        foreign = [ownership_problem(rollout_id, row.staging_key, row.capture_key) for row in receipt.manifest]
        try:
            for problem in foreign:
                if problem is not None:
                    raise ReceiptVerificationError(*problem)
            async with AsyncRedisStagingSource(
                topology.client, SourceSettings(namespace=target.namespace, cluster=target.cluster)
            ) as source:
                snapshots = await source.fetch([row.staging_key for row in receipt.manifest])
            if state["chains"] is not None:
                outcome["chains"] = _verify_chains(receipt, state["chains"], snapshots)
                receipt = _first_trainable(receipt, state["chains"], outcome["chains"])
                snapshots = [s for s in snapshots if s.model_call_id in {r.model_call_id for r in receipt.manifest}]
            row = verify_and_linearize(receipt, snapshots)
        except KeyError as exc:
            outcome |= {
                "verified": False,
                "code": SkipCode.MISSING_RECORD,
                "detail": str(exc.args[0] if exc.args else exc),
            }
            if state["fenced"] and state["receipt"] is not None:
                # The trainer's ack retires the ledger (fence), then deletes the staged records.
                outcome |= {"consumed": True, "code": "consumed", "detail": "acknowledged by a trainer"}
        except CodecError as exc:
            outcome |= {"verified": False, "code": SkipCode.CORRUPT_RECORD, "detail": str(exc)}
        except ReceiptVerificationError as exc:
            outcome |= {"verified": False, "code": exc.code, "detail": exc.detail}
        else:
            outcome |= {
                "verified": True,
                "terminal": receipt.terminal_model_call_id,
                "selection": receipt.terminal_selection,
                "calls": len(row.model_call_ids),
                "tokens": len(row.token_ids),
                "generated_tokens": sum(1 for mask in row.token_mask if mask == 1.0),
            }
    if as_json:
        _write_json(outcome)
    elif outcome["consumed"]:
        stdout_console().print(
            f"[green]consumed[/] {rollout_id}: a trainer acknowledged it (receipt kept, ledger retired, staged "
            f"records removed); nothing left to verify"
        )
    elif outcome["verified"]:
        stdout_console().print(
            f"[green]verified[/] {rollout_id}: {outcome['tokens']} tokens ({outcome['generated_tokens']} generated) "
            f"over {outcome['calls']} call(s), terminal {outcome['terminal']} ({outcome['selection']}); "
            f"{source_of_receipt}"
        )
    else:
        stdout_console().print(
            f"[red]NOT verified[/] {rollout_id}: {outcome['code']}: {outcome['detail']} ({source_of_receipt})"
        )
    for chain in [] if as_json else outcome.get("chains", []):
        shown = f"{chain['tokens']} tokens" if chain["verified"] else f"{chain['code']}: {chain['detail']}"
        stdout_console().print(f"  chain {chain['index']} (root {chain['root']}): {shown}")
    return EXIT_OK if outcome["verified"] or outcome["consumed"] else EXIT_FAILURE


# --- tail --------------------------------------------------------------------------------------------


async def tail_rollout(
    target: RedisTarget, rollout_id: str, *, count: int | None, timeout_s: float | None, from_start: bool
) -> int:
    """``staging-sink tail R``: print the rollout's calls entries as they are staged (``XREAD BLOCK``).

    Ends after *count* entries, after *timeout_s* seconds, or on Ctrl-C; exit 0 in every case.
    """
    checked_rollout_id(rollout_id)
    console = stdout_console()
    stream = calls_stream(target.namespace, rollout_id)
    seen = 0
    last_id = "0-0" if from_start else "$"
    async with open_topology(target) as topology:
        client = topology.node_for_key(stream)
        with map_redis_errors(f"read the calls of {rollout_id!r}"):
            if last_id == "$":
                # Resolve '$' once, so an entry staged between two reads is never skipped.
                newest = await client.xrevrange(stream, count=1)
                last_id = _entry(newest[0])[0] if newest else "0-0"
            known = bool(await client.exists(stream))
        deadline = timeout_s if timeout_s is not None else float("inf")
        async with anyio.create_task_group() as group:
            await group.start(cancel_on_signal, group.cancel_scope)  # Ctrl-C ends the tail normally
            stderr_console().print(f"following the calls of {rollout_id} from {last_id}; Ctrl-C stops")
            if not known:
                sys.stderr.write(
                    f"note: no such rollout yet: {rollout_id!r} has no calls stream in namespace "
                    f"{target.namespace!r} at {target.display_url}; waiting for its first staged record\n"
                )
            with anyio.move_on_after(deadline):
                while count is None or seen < count:
                    with map_redis_errors(f"read the calls of {rollout_id!r}"):
                        wanted = None if count is None else count - seen
                        reply: Any = await client.xread({stream: last_id}, count=wanted, block=_TAIL_BLOCK_MS)
                    for _stream, entries in reply or []:
                        for raw in entries:
                            last_id, fields = _entry(raw)
                            seen += 1
                            console.print(
                                f"{last_id} call={fields.get('call', '')} parent={fields.get('parent') or '-'} "
                                f"prev={fields.get('prev_len', '')} delta={fields.get('delta_len', '')} "
                                f"cum={fields.get('cum_len', '')} weight={fields.get('weight', '')} "
                                f"bytes={fields.get('bytes', '')} key={fields.get('key', '')}"
                            )
            group.cancel_scope.cancel()
    return EXIT_OK
