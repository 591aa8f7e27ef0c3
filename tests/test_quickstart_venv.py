"""README's quickstart works as written: a fresh venv installed exactly as README says runs the example."""

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


def _install_command() -> str:
    """The install part of README's first command (``python3 -m venv .venv && .venv/bin/pip install ...``)."""
    first = re.findall(r"```sh\n(.*?)```", README, flags=re.DOTALL)[0].strip()
    install = " && ".join(part.strip() for part in first.split("&&") if "staging-sink" not in part.split()[0])
    assert install.startswith("python3 -m venv .venv") and ".venv/bin/pip install" in install, first
    return install


def test_the_install_command_is_what_readme_says() -> None:
    assert _install_command() == "python3 -m venv .venv && .venv/bin/pip install -e '.[embedded]' -e tools"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quickstart_runs_in_a_venv_installed_as_readme_says(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is needed to clone the repository")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    python_dir = str(Path(sys.executable).resolve().parent)  # a python3 for `python3 -m venv`, as a user has
    env["PATH"] = os.pathsep.join([python_dir, env.get("PATH", "")])
    install = subprocess.run(
        ["bash", "-c", _install_command()], cwd=clone, env=env, capture_output=True, text=True, timeout=780, check=False
    )
    assert install.returncode == 0, install.stderr[-3000:]
    example = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-W", "error", "examples/quickstart.py"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert example.returncode == 0, example.stderr[-3000:]
    expected = re.search(r"It prints `(.*?)`", README)
    assert expected is not None
    assert example.stdout.strip() == expected.group(1)
