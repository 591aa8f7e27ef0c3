"""What an export refuses before writing anything (sink.trainer.export, no server): an item that is not a pulled
rollout, a chain the rollout does not have, a Parquet export without pyarrow; each error names what was wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sink.errors import BatchInputError, ExtraMissingError
from sink.trainer.export import export_record, write_export
from tests.helpers.rows import verified_pulled


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
