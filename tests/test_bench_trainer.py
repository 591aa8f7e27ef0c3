"""``staging-sink bench trainer`` measures collation and packing beside the pull path and the floor."""

from __future__ import annotations

import json

import pytest

from sink_cli.main import main
from sink_tools.bench.trainer import TrainerFigures, format_report


def test_bench_trainer_reports_collate_and_pack_columns(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--rollouts", "3", "--calls", "2", "--tokens", "256", "--repeats", "1", "--json"]
    assert main(["bench", "trainer", "--redis-url", redis_url, *args]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["pull_collate_ns"] > 0 and raw["pull_pack_ns"] > 0 and raw["pull_numpy_ns"] > 0
    report = format_report(TrainerFigures(**raw))
    assert "trainer loop + collate" in report and "trainer loop + pack" in report
    assert "packed loop / floor" in report and "target <= 3x" in report
