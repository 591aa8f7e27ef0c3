"""``staging-sink bench groups`` delivers every group whole and counts what groups add to plain pulls: one group
entry per group, so one rank or several consume every member once; the assembler gathers the groups."""

from __future__ import annotations

import json

import pytest

from sink_cli.main import main
from sink_tools.bench.groups import GroupFigures, ModeFigures, format_report


def test_bench_groups_reports_each_mode(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--groups", "3", "--group-size", "4", "--calls", "1", "--tokens", "128", "--pull", "4", "--repeats", "1"]
    argv = ["bench", "groups", "--redis-url", redis_url, *args, "--modes", "pull,groups,groups-2", "--json"]
    assert main(argv) == 0
    raw = json.loads(capsys.readouterr().out)
    figures = GroupFigures(**{**raw, "modes": tuple(ModeFigures(**mode) for mode in raw["modes"])})
    pull, one_rank, two_ranks = figures.modes
    assert [m.mode for m in figures.modes] == ["pull", "groups", "groups-2"]
    # Each group entry goes to one rank, whole: every member consumed once, however many ranks take turns.
    for mode in figures.modes:
        assert mode.consumed_per_rollout == 1.0 and mode.consumed_again == 0, mode
        assert mode.round_trips_per_group > 0 and mode.assembly_round_trips_per_group > 0 and mode.entry_bytes > 0
    # The group record costs the assembler a script per member and a few writes per group.
    assert one_rank.assembly_round_trips_per_group > pull.assembly_round_trips_per_group
    assert two_ranks.entry_bytes < pull.entry_bytes  # a group entry names its members; their receipts are in the record
    assert "groups-2" in format_report(figures) and "round trips/group" in format_report(figures)


def test_bench_groups_refuses_an_unknown_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "groups", "--modes", "groups-x"])
    assert "--modes" in capsys.readouterr().err
