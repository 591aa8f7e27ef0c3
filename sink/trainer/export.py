"""Keep what was trained: verified rows written to JSON Lines or Parquet before ``ack`` deletes them.

``RolloutReader.ack`` deletes the staged records; export first when the rows
must outlive training (audits, replays, offline RL). One exported row per
verified rollout or chain (skipped rollouts have no row and are not written):

``rollout_id``, ``chain_index`` (0, or the chain of a multi-chain rollout: one line per chain, contract
§14.4), ``token_ids`` (ints), ``token_mask`` and ``logprobs``
(floats, exactly the verified row's values; Parquet stores them as float64), ``reward``, ``group_id``/``group_size`` (``None`` outside a group),
``prompt_len``, ``model_call_ids``, ``weight_versions`` and ``sampling`` (per call, root
first; ``sampling`` is each call's sampling provenance as its extras hold it,
:meth:`~sink.contract.sampling.SamplingProvenance.as_extras`, or ``None`` when the call has none),
``terminal_model_call_id``, ``terminal_selection`` and ``receipt``
(the token-free receipt as a JSON object; Parquet stores its JSON text, and
:func:`read_export` returns the object for both formats).

From Python: :func:`write_export` (pulled rollouts) or :func:`export_rollouts`
(by id, from the stored receipts, the same as ``staging-sink export``);
:func:`read_export` reads either format back. Parquet needs ``pyarrow`` (the
``parquet`` extra).

When to acknowledge: after the optimizer step that used the rows (and after
exporting them). A crash between ``pull`` and ``ack`` loses nothing: the
rollouts stay pending and another rank reclaims them after ``claim_idle_ms``
(or the same rank, restarted under the same consumer name, at once); they are
then trained again, so a step that was applied but not acknowledged is
repeated (at-least-once delivery).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.contract.records import RolloutReceipt
from sink.contract.sampling import SAMPLING_FIELD_TYPES, SamplingProvenance
from sink.contract.skip_codes import SkipCode
from sink.errors import (
    BatchInputError,
    CodecError,
    ExtraMissingError,
    ReceiptVerificationError,
    RolloutRetiredError,
    RowUnavailableError,
)
from sink.keys import DEFAULT_NAMESPACE, receipt_key, validate_rollout_id
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.chains import build_chains
from sink.settings import SourceSettings
from sink.store.connection import map_redis_errors
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.pulled import PulledRollout, fetch_and_verify
from sink.trainer.row import LinearizedRow

__all__ = ("EXPORT_FORMATS", "ExportFormat", "export_record", "export_rollouts", "read_export", "write_export")

ExportFormat = Literal["jsonl", "parquet"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("jsonl", "parquet")

logger = logging.getLogger(__name__)


def export_record(pulled: PulledRollout, chain_index: int | None = None) -> dict[str, Any]:
    """The exported row of one trainable pulled rollout (of its chain *chain_index*, contract §14.4).

    :raises BatchInputError: *pulled* is not a trainable :class:`PulledRollout`, or has no such chain row.
    """
    if not isinstance(pulled, PulledRollout) or not pulled.trainable:
        raise BatchInputError(f"only trainable pulled rollouts have a row to export, got {pulled!r}")
    rows = [row for row in pulled.rows if chain_index is None or row.chain_index == chain_index]
    if len(rows) != 1:
        raise BatchInputError(f"rollout {pulled.rollout_id!r} has no single row for chain {chain_index!r}")
    row, receipt = rows[0], pulled.receipt
    return {
        "rollout_id": row.rollout_id,
        "chain_index": row.chain_index,
        "token_ids": list(row.token_ids),
        "token_mask": list(row.token_mask),
        "logprobs": list(row.logprobs),
        "reward": receipt.reward,
        "group_id": None if pulled.group is None else pulled.group.group_id,
        "group_size": None if pulled.group is None else pulled.group.group_size,
        "prompt_len": row.prompt_len,
        "model_call_ids": list(row.model_call_ids),
        "weight_versions": list(row.weight_versions),
        "sampling": [None if provenance is None else provenance.as_extras() for provenance in _sampling(row)],
        "terminal_model_call_id": row.model_call_ids[-1] if pulled.chains else receipt.terminal_model_call_id,
        "terminal_selection": _selection(pulled, row.chain_index),
        "receipt": receipt.model_dump(mode="json"),
    }


def _sampling(row: LinearizedRow) -> tuple[SamplingProvenance | None, ...]:
    return row.sampling or (None,) * len(row.model_call_ids)


def _selection(pulled: PulledRollout, chain_index: int) -> str | None:
    if pulled.chains is None:
        return pulled.receipt.terminal_selection
    return pulled.chains.chains[chain_index].selection


def _check_format(fmt: object) -> ExportFormat:
    for known in EXPORT_FORMATS:
        if fmt == known:
            return known
    raise BatchInputError(f"unknown export format {fmt!r}; expected one of {EXPORT_FORMATS}")


def _import_pyarrow() -> Any:
    try:
        pyarrow = importlib.import_module("pyarrow")
        importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise ExtraMissingError(
            "Parquet needs pyarrow, the 'parquet' extra: pip install -e '.[parquet]' in a clone of staging-sink "
            "(or pip install pyarrow)"
        ) from exc
    return pyarrow


def _write_jsonl(records: Iterable[dict[str, Any]], out: IO[str]) -> int:
    count = 0
    for record in records:
        out.write(json.dumps(record, allow_nan=False) + "\n")
        count += 1
    return count


def write_export(
    pulled: Sequence[PulledRollout], destination: str | Path | IO[str], *, fmt: ExportFormat = "jsonl"
) -> int:
    """Write the rows of the trainable rollouts in *pulled* to *destination* (a path, or a text stream for
    ``jsonl``); skipped rollouts are left out.

    :returns: how many rows were written.
    :raises BatchInputError: an unknown format, an item that is not a :class:`PulledRollout`, a Parquet
        export to a stream, or a token id a Parquet int64 column cannot hold (from 2**63; JSON Lines holds it).
    """
    fmt = _check_format(fmt)
    if isinstance(pulled, str | bytes) or any(not isinstance(p, PulledRollout) for p in pulled):
        raise BatchInputError("write_export takes a sequence of PulledRollout")
    records = [export_record(p, row.chain_index) for p in pulled if p.trainable for row in p.rows]
    if fmt == "parquet":
        if not isinstance(destination, str | Path):
            raise BatchInputError("a Parquet export needs a file path")
        pyarrow = _import_pyarrow()
        _check_int64(records)
        # Parquet keeps the receipt as its JSON text (one string column); read_export turns it back into an object.
        columns = [{**record, "receipt": json.dumps(record["receipt"], sort_keys=True)} for record in records]
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(columns, schema=_parquet_schema(pyarrow)), destination)
        return len(records)
    if isinstance(destination, str | Path):
        with open(destination, "w", encoding="utf-8") as out:
            return _write_jsonl(records, out)
    return _write_jsonl(records, destination)


_INT64_MAX = 2**63 - 1


def _check_int64(records: Sequence[dict[str, Any]]) -> None:
    """Refuse what Parquet's int64 columns cannot hold: token ids are unsigned 64-bit (contract §4.2).

    :raises BatchInputError: a token id or weight version above 2**63 - 1, naming the rollout (nothing written).
    """
    for record in records:
        for column in ("token_ids", "weight_versions"):
            largest = max(record[column], default=0)
            if largest > _INT64_MAX:
                raise BatchInputError(
                    f"rollout {record['rollout_id']!r} chain {record['chain_index']}: {column} holds "
                    f"{largest}, beyond Parquet's int64 column; export it as fmt='jsonl' (nothing written)"
                )


def _parquet_schema(pa: Any) -> Any:
    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("chain_index", pa.int64()),
            ("token_ids", pa.list_(pa.int64())),
            ("token_mask", pa.list_(pa.float64())),
            ("logprobs", pa.list_(pa.float64())),
            ("reward", pa.float64()),
            ("group_id", pa.string()),
            ("group_size", pa.int64()),
            ("prompt_len", pa.int64()),
            ("model_call_ids", pa.list_(pa.string())),
            ("weight_versions", pa.list_(pa.int64())),
            ("sampling", pa.list_(_sampling_struct(pa))),
            ("terminal_model_call_id", pa.string()),
            ("terminal_selection", pa.string()),
            ("receipt", pa.string()),
        ]
    )


def _sampling_struct(pa: Any) -> Any:
    """One call's sampling provenance in Parquet: a struct of the entry's fields (a null struct: unknown)."""
    kinds = {float: pa.float64(), int: pa.int64(), bool: pa.bool_(), str: pa.string()}
    return pa.struct([(name, kinds[kind]) for name, kind in SAMPLING_FIELD_TYPES.items()])


def read_export(path: str | Path, *, fmt: ExportFormat | None = None) -> list[dict[str, Any]]:
    """The rows of an export file (format from the suffix ``.parquet`` unless given), as :func:`export_record`
    built them (float columns are stored as float64, so every value comes back exactly)."""
    fmt = _check_format(fmt or ("parquet" if str(path).endswith(".parquet") else "jsonl"))
    if fmt == "parquet":
        rows: list[dict[str, Any]] = _import_pyarrow().parquet.read_table(path).to_pylist()
        return [{**row, "receipt": json.loads(row["receipt"])} for row in rows]
    with open(path, encoding="utf-8") as source:
        return [json.loads(line) for line in source if line.strip()]


async def export_rollouts(
    client: aioredis.Redis | RedisCluster,
    rollout_ids: Sequence[str],
    destination: str | Path | IO[str],
    *,
    fmt: ExportFormat = "jsonl",
    namespace: str = DEFAULT_NAMESPACE,
    cluster: bool = False,
) -> int:
    """Export rollouts by id: read each stored receipt, fetch and verify its staged records, write the rows.

    The rows are those the reader delivers: a multi-chain rollout (contract §14) gives one line per healthy chain,
    its chain record built from the live ledger as the assembler built it; a chain the reader would skip is not
    written and is logged. Nothing is consumed or acknowledged; run it before ``ack`` (which deletes the records
    and retires the ledger). Every rollout must have a trainable row, or nothing is written. Group ids are not
    known here (they travel on the receipt entries).

    :returns: how many rows were written.
    :raises BatchInputError: an invalid rollout id or format.
    :raises RowUnavailableError: a rollout has no stored receipt, its ledger is retired, or a staged record it
        needs is gone (nothing written).
    :raises ReceiptVerificationError: a rollout has no trainable row; ``code`` is the reader's skip code
        (nothing written).
    :raises CodecError: a stored receipt or record is corrupt (nothing written).
    :raises StagingConnectionError: the server could not be reached.
    """
    fmt = _check_format(fmt)
    if isinstance(rollout_ids, str | bytes):
        raise BatchInputError("export_rollouts takes a sequence of rollout ids, not a single str")
    try:
        ids = [validate_rollout_id(rollout_id) for rollout_id in dict.fromkeys(rollout_ids)]
    except ValueError as exc:
        raise BatchInputError(str(exc)) from exc
    settings = SourceSettings(namespace=namespace, cluster=cluster)
    async with (
        AsyncRedisStagingSource(client, settings) as source,
        RedisCaptureLedger(client, settings) as ledger,
    ):
        pulled = [await _pull_by_id(client, source, ledger, namespace, rollout_id) for rollout_id in ids]
    return write_export(pulled, destination, fmt=fmt)


async def _pull_by_id(
    client: aioredis.Redis | RedisCluster,
    source: AsyncRedisStagingSource,
    ledger: RedisCaptureLedger,
    namespace: str,
    rollout_id: str,
) -> PulledRollout:
    """*rollout_id* fetched and verified as the reader delivers it (a multi-chain rollout's chain record built
    from its live ledger, as the assembler built it); a rollout with no trainable row raises."""
    with map_redis_errors(f"read the receipt of {rollout_id!r}"):
        text = await client.get(receipt_key(namespace, rollout_id))
    if text is None:
        raise RowUnavailableError(f"rollout {rollout_id!r} has no stored receipt (not finished, or acknowledged)")
    try:
        receipt = RolloutReceipt.model_validate_json(text)
    except ValueError as exc:
        raise CodecError(f"stored receipt of {rollout_id!r} is corrupt: {exc}") from exc
    try:
        manifest, view = await ledger.manifest_and_chains(rollout_id)
    except RolloutRetiredError as exc:
        raise RowUnavailableError(f"rollout {rollout_id!r} is retired (acknowledged, or `retire`d)") from exc
    pulled = await fetch_and_verify(source, receipt, build_chains(receipt, manifest, view))
    if pulled.skip_code is not None:
        if pulled.skip_code == SkipCode.MISSING_RECORD:
            raise RowUnavailableError(f"rollout {rollout_id!r}: staged record gone ({pulled.skip_reason})")
        if pulled.skip_code == SkipCode.CORRUPT_RECORD:
            raise CodecError(f"rollout {rollout_id!r}: staged record corrupt ({pulled.skip_reason})")
        reason = f"rollout {rollout_id!r} has no trainable row: {pulled.skip_reason}"
        raise ReceiptVerificationError(pulled.skip_code, reason)
    for skip in pulled.chain_skips:  # as the reader delivers it: the healthy chains only
        logger.warning(
            "export of rollout %r: chain %d (root %s) not written: %s (%s)",
            rollout_id, skip.chain_index, skip.root_call_id, skip.skip_code, skip.skip_reason,
        )  # fmt: skip
    return pulled
