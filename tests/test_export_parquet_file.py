"""The Parquet file an export writes (sink.trainer.export, no server): every documented column with its type, even
when no row has a group or there is no row at all; every value read back as export_record built it; the receipt
column holds the receipt's JSON text with sorted keys."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from sink.rollout.done_event import GroupTag
from sink.trainer.export import ExportFormat, export_record, read_export, write_export
from tests.helpers.rows import skipped_pulled, verified_pulled
from tests.helpers.sampling import sampling_extras

pa: Any = importlib.import_module("pyarrow")
pq: Any = importlib.import_module("pyarrow.parquet")

# The columns of the module docstring, in order, with the types a reader of the file sees.
COLUMNS = [
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
    (
        "sampling",
        pa.list_(
            pa.struct(
                [
                    ("source", pa.string()),
                    *((name, pa.float64()) for name in ("temperature", "top_p")),
                    ("top_k", pa.int64()),
                    *((name, pa.float64()) for name in ("min_p", "presence_penalty", "frequency_penalty")),
                    ("repetition_penalty", pa.float64()),
                    *((name, pa.int64()) for name in ("seed", "max_tokens", "min_tokens")),
                    ("ignore_eos", pa.bool_()),
                    ("logit_bias", pa.bool_()),
                    ("constraint", pa.string()),
                    ("logprobs_mode", pa.string()),
                ]
            )
        ),
    ),
    ("terminal_model_call_id", pa.string()),
    ("terminal_selection", pa.string()),
    ("receipt", pa.string()),
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_every_column_reads_back_as_export_record_built_it(tmp_path: Path, fmt: ExportFormat) -> None:
    extras = (sampling_extras(), None, sampling_extras(constraint="tool_choice", seed=7, top_p=None))
    pulled = [
        verified_pulled("a", lengths=(8, 6, 5), weight_versions=(1, 2, 2), group=GroupTag("g", 2), extras=extras),
        verified_pulled("b", reward=None),
    ]
    path = tmp_path / f"rows.{fmt}"
    assert write_export(pulled, path, fmt=fmt) == 2
    rows = read_export(path)
    assert rows == [export_record(item) for item in pulled]
    # Each call's provenance as its extras hold it, None where unknown.
    assert rows[0]["sampling"] == [extras[0]["sampling"], None, extras[2]["sampling"]]
    assert rows[1]["sampling"] == [None, None]
    assert [(row["chain_index"], row["terminal_model_call_id"], row["terminal_selection"]) for row in rows] == [
        (0, "c2", "declared"),
        (0, "c1", "declared"),
    ]


@pytest.mark.parametrize("kept", [1, 0], ids=["rows-without-groups", "no-rows"])
def test_the_parquet_file_has_every_documented_column_and_type(tmp_path: Path, kept: int) -> None:
    pulled = [verified_pulled("a", reward=None), skipped_pulled("gone")][1 - kept :]
    path = tmp_path / "rows.parquet"
    assert write_export(pulled, path, fmt="parquet") == kept
    schema = pq.read_schema(path)
    assert [(field.name, field.type) for field in schema] == COLUMNS
    assert pq.read_table(path).num_rows == kept


def test_the_parquet_receipt_column_is_the_receipts_json_text_with_sorted_keys(tmp_path: Path) -> None:
    item = verified_pulled("a")
    path = tmp_path / "rows.parquet"
    write_export([item], path, fmt="parquet")
    (text,) = pq.read_table(path).column("receipt").to_pylist()
    receipt = export_record(item)["receipt"]
    assert text == json.dumps(receipt, sort_keys=True)
    assert text != json.dumps(receipt)  # the receipt's own field order is not sorted: the test can tell them apart
