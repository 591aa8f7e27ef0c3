"""A multi-chain rollout's export (sink.trainer.export, contract §14.4, no server): one line per chain, each with
its own chain index, calls, terminal call and terminal selection, in both formats (JSON Lines the default)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from sink.trainer.export import ExportFormat, export_record, read_export, write_export
from tests.helpers.rows import multi_chain_pulled, verified_pulled


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_each_chain_is_one_line_with_its_own_terminal_and_selection(tmp_path: Path, fmt: ExportFormat) -> None:
    chains = multi_chain_pulled("mc", trees=((8, 6), (8, 6, 5)))  # chain 1's terminal b2 is the declared one
    single = verified_pulled("one")
    path = tmp_path / f"rows.{fmt}"
    assert write_export([chains, single], path, fmt=fmt) == 3
    rows = read_export(path)
    described = [
        (row["rollout_id"], row["chain_index"], row["model_call_ids"], row["terminal_model_call_id"]) for row in rows
    ]
    assert described == [
        ("mc", 0, ["a0", "a1"], "a1"),
        ("mc", 1, ["b0", "b1", "b2"], "b2"),
        ("one", 0, ["c0", "c1"], "c1"),
    ]
    assert [row["terminal_selection"] for row in rows] == ["heuristic", "declared", "declared"]
    assert rows == [export_record(chains, 0), export_record(chains, 1), export_record(single)]
    assert [row["token_ids"] for row in rows[:2]] == [list(row.token_ids) for row in chains.rows]
    default = io.StringIO()
    assert write_export([chains, single], default) == 3  # no format given: JSON Lines, here to a text stream
    assert [json.loads(line) for line in default.getvalue().splitlines()] == rows
