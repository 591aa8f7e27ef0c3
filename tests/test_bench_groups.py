"""``staging-sink bench groups`` delivers every group whole and counts what the group protocol adds to plain pulls:
one rank consumes every member once; over several ranks the rank completing a group consumes the others' again."""

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
    assert pull.consumed_per_rollout == one_rank.consumed_per_rollout == 1.0 and pull.taken_over == 0
    # Two ranks taking turns with pulls of 4: each group's members land on both, the completing rank takes over.
    assert two_ranks.taken_over > 0 and two_ranks.consumed_per_rollout > 1.0
    assert one_rank.round_trips_per_group > pull.round_trips_per_group > 0
    assert figures.entry_bytes > 0
    assert "groups-2" in format_report(figures) and "round trips/group" in format_report(figures)


def test_bench_groups_refuses_an_unknown_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "groups", "--modes", "groups-x"])
    assert "--modes" in capsys.readouterr().err
