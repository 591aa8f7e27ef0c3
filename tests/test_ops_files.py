"""Deployment files: secrets are ignored by git, the ACL command deploy/valkey.conf shows works as written, and
the Docker image installs every extra its services and documented commands need."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gitignore_covers_the_plain_text_secrets() -> None:
    for path in (".env", "deploy/users.acl"):
        result = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, check=False
        )
        assert result.returncode == 0, f"{path} is not ignored by .gitignore"
    example = ["git", "check-ignore", "--no-index", "-q", "deploy/users.acl.example"]
    assert subprocess.run(example, cwd=ROOT, check=False).returncode == 1  # the placeholder file stays tracked


def test_the_acl_command_in_valkey_conf_writes_the_acl_and_env_files(tmp_path: Path) -> None:
    text = (ROOT / "deploy" / "valkey.conf").read_text()
    match = re.search(r"Generate with: (.+)$", text, re.MULTILINE)
    assert match, "deploy/valkey.conf shows no ACL-generation command"
    command = match.group(1).strip()
    argv = shlex.split(command.replace(">", " > "))
    assert argv[0] == "staging-sink", command
    redirect = argv.index(">") if ">" in argv else None
    args = argv[1:redirect]
    (tmp_path / "deploy").mkdir()
    with open(tmp_path / argv[redirect + 1], "w") if redirect else open(os.devnull, "w") as out:
        result = subprocess.run(
            [sys.executable, "-m", "sink_cli", *args], cwd=tmp_path, stdout=out, stderr=subprocess.PIPE, text=True, check=False
        )
    assert result.returncode == 0, result.stderr
    acl = (tmp_path / "deploy" / "users.acl").read_text()
    env = (tmp_path / ".env").read_text()
    assert "user worker on" in acl and "user ops on" in acl and "user default off" in acl
    assert "STG_OPS_PASSWORD=" in env and "STG_ADMIN_PASSWORD=" in env  # docker-compose.yml needs both
    assert oct((tmp_path / ".env").stat().st_mode & 0o777) == "0o600"


def test_the_image_installs_the_extras_of_its_documented_commands() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    match = re.search(r'pip install "\.\[([a-z,]+)\]" \./tools ', dockerfile)  # ./tools: every service's command
    assert match, dockerfile
    assert {"metrics", "proxy", "parquet"} <= set(match.group(1).split(","))
