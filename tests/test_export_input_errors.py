"""What an export refuses before writing anything (sink.trainer.export, no server): an item that is not a pulled
rollout, a chain the rollout does not have, a Parquet export without pyarrow, a token id Parquet's int64 cannot hold;
each error names what was wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sink.contract.records import RolloutReceipt
from sink.errors import BatchInputError, ExtraMissingError
from sink.trainer.export import export_record, read_export, write_export
from sink.trainer.pulled import PulledRollout
from sink.trainer.verify import verify_and_linearize
from tests.helpers.e2e import call_record_of
from tests.helpers.rows import verified_pulled
from tests.helpers.staging import record_of_tokens


def test_an_item_that_is_not_a_pulled_rollout_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(BatchInputError) as record_error:
        export_record("exp-0")  # type: ignore[arg-type]
    assert "'exp-0'" in str(record_error.value)
    path = tmp_path / "rows.jsonl"
    with pytest.raises(BatchInputError) as write_error:
        write_export([verified_pulled("a"), "exp-0"], path)  # type: ignore[list-item]
    assert "PulledRollout" in str(write_error.value)
    assert not path.exists()


def test_a_chain_the_rollout_does_not_have_is_refused_naming_the_rollout_and_the_chain() -> None:
    with pytest.raises(BatchInputError) as info:
        export_record(verified_pulled("a"), chain_index=3)
    assert "'a'" in str(info.value) and "chain 3" in str(info.value)


def test_a_parquet_export_without_pyarrow_names_the_extra_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # unimportable, as without the parquet extra
    path = tmp_path / "rows.parquet"
    with pytest.raises(ExtraMissingError) as info:
        write_export([verified_pulled("a")], path, fmt="parquet")
    assert "'parquet' extra" in str(info.value) and "[parquet]" in str(info.value) and "pyarrow" in str(info.value)
    assert not path.exists()


def _pulled_with_ids(rollout_id: str, ids: list[int]) -> PulledRollout:
    """A trainable one-call rollout of *ids* (the first a prompt token)."""
    record = record_of_tokens(rollout_id, "c0", ids, 1, [-0.5] * (len(ids) - 1))
    receipt = RolloutReceipt(
        rollout_id=rollout_id,
        reward=1.0,
        terminal_model_call_id="c0",
        manifest=[call_record_of(record, admitted_at=1000.0)],
        terminal_selection="declared",
    )
    return PulledRollout(receipt=receipt, row=verify_and_linearize(receipt, [record]))


def test_a_token_id_beyond_int64_is_refused_for_parquet_naming_the_rollout_and_writes_nothing(tmp_path: Path) -> None:
    big = 2**63  # a valid token id (the contract's ids are unsigned 64-bit), beyond Parquet's int64 column
    pulled = [verified_pulled("small"), _pulled_with_ids("big", [1, big, 3])]
    path = tmp_path / "rows.parquet"
    with pytest.raises(BatchInputError) as info:
        write_export(pulled, path, fmt="parquet")
    message = str(info.value)
    assert "'big'" in message and str(big) in message and "jsonl" in message
    assert not path.exists()
    jsonl = tmp_path / "rows.jsonl"
    assert write_export(pulled, jsonl, fmt="jsonl") == 2  # JSON Lines holds it
    assert read_export(jsonl)[1]["token_ids"] == [1, big, 3]
    limit = 2**63 - 1  # the largest id int64 holds is written and read back
    assert write_export([_pulled_with_ids("edge", [1, limit])], path, fmt="parquet") == 1
    assert read_export(path)[0]["token_ids"] == [1, limit]
