"""The two distributions as pip builds them: the library's wheel holds only the library, the tools' wheel the rest."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _wheel_top_level(project: Path, out: Path) -> tuple[str, set[str]]:
    """Build *project*'s wheel with pip (as an install from a clone does) and return its file name and the names at
    the top of the archive."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(project)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return wheel.name, {name.split("/", 1)[0] for name in archive.namelist()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_library_wheel_holds_sink_and_worker_and_the_tools_wheel_the_command_line(tmp_path: Path) -> None:
    name, top = _wheel_top_level(ROOT, tmp_path / "library")
    assert name.startswith("staging_sink-0.1.0-") and top == {"sink", "worker", "staging_sink-0.1.0.dist-info"}, top
    name, top = _wheel_top_level(ROOT / "tools", tmp_path / "tools")
    assert name.startswith("staging_sink_tools-0.1.0-"), name
    assert top == {"sink_tools", "sink_cli", "staging_sink_tools-0.1.0.dist-info"}, top
    with zipfile.ZipFile(next((tmp_path / "tools").glob("*.whl"))) as archive:
        entry_points = archive.read("staging_sink_tools-0.1.0.dist-info/entry_points.txt").decode()
    assert "staging-sink = sink_cli.main:main" in entry_points
