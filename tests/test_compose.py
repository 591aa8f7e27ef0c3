"""docker-compose.yml, the Dockerfile, .dockerignore and deploy/: structure (Docker cannot run here, so the compose
file is checked statically), and the Valkey config, ACL and health check run for real."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tomllib
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
import yaml

from sink.ops.access.render import ADMIN_ROLE, ROLE_NAMES, password_env_var, render_acl_example
from sink.store.durability import REQUIRED_CONFIG, verify_durability
from sink_cli.main import main
from tests.helpers.acl import AclServer
from tests.helpers.servers import require_binary, skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
VALKEY_CONF = ROOT / "deploy" / "valkey.conf"
ACL_EXAMPLE = ROOT / "deploy" / "users.acl.example"

DOCKERIGNORE = ROOT / ".dockerignore"

COMPOSE_SUBCOMMANDS = ("assembler", "demo", "trainer", "metrics", "proxy")
"""The ``staging-sink`` subcommands docker-compose.yml runs; the CLI must provide each of them."""
ADMIN_SERVICES = {"setup": "setup", "prune": "prune"}
"""One-shot and maintenance services that run as the admin user (they load functions, delete others' keys)."""
SERVICE_ROLES = {
    "assembler": "assembler",
    "demo-worker": "worker",
    "trainer": "trainer",
    "metrics": "ops",
    "capture-proxy": "worker",
}
"""Which ACL user each application service logs in as."""
PROFILES = {
    "demo-worker": ["demo"],
    "trainer": ["reference-trainer"],
    "prometheus": ["monitoring"],
    "grafana": ["monitoring"],
    "capture-proxy": ["proxy"],
    "engine": ["proxy"],
}
"""Services that start only with their profile: the demo worker and the reference trainer never compete with a
real trainer, and monitoring is opt-in."""
SECRET_VARIABLE = re.compile(r"\$\{STG_[A-Z_]*PASSWORD")


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def command_words(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    words = command if isinstance(command, list) else str(command or "").split()
    return [str(word) for word in words]


def valkey_conf() -> dict[str, str]:
    directives: dict[str, str] = {}
    for line in VALKEY_CONF.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.strip().partition(" ")
            directives[name.lower()] = value.strip()
    return directives


def test_the_compose_file_defines_the_stack() -> None:
    services = compose()["services"]
    assert set(services) == {"valkey", *SERVICE_ROLES, *ADMIN_SERVICES, "prometheus", "grafana", "engine"}
    for name, service in services.items():
        if name != "grafana":  # grafana's image runs its server by default
            assert command_words(service), f"service {name} has no command"
        assert service.get("profiles") == PROFILES.get(name), name


def test_every_service_has_a_health_check() -> None:
    for name, service in compose()["services"].items():
        if name == "setup":  # one-shot: runs, exits 0, and the others wait for that
            assert service["restart"] == "no" and service["healthcheck"] == {"disable": True}
            continue
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_no_secret_on_a_command_line() -> None:
    for name, service in compose()["services"].items():
        words = [*command_words(service), *(str(w) for w in service["healthcheck"].get("test", []))]
        assert not any(SECRET_VARIABLE.search(word) or "PASSWORD" in word for word in words), (name, words)
        assert "--redis-url" not in words and "--pass" not in words and "-a" not in words, name


def test_every_image_is_pinned_to_a_version() -> None:
    images = {name: service["image"] for name, service in compose()["services"].items()}
    for name, image in images.items():
        if image == "staging-sink:local":
            continue  # built from the Dockerfile, whose base image is pinned
        repository, _, tag = image.rpartition(":")
        assert repository and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), (name, image)
    base = re.search(r"^FROM (\S+)$", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert base is not None and re.fullmatch(r"python:\d+\.\d+\.\d+-slim", base.group(1)), base


def _bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)([kmg]b?)", size.lower())
    assert match, size
    scale: int = 1024 ** ("kmg".index(match.group(2)[0]) + 1)
    return int(match.group(1)) * scale


def test_maxmemory_is_set_below_the_container_limit() -> None:
    valkey = compose()["services"]["valkey"]
    limit, maxmemory = _bytes(valkey["mem_limit"]), _bytes(valkey_conf()["maxmemory"])
    assert maxmemory <= 0.8 * limit  # room for the AOF rewrite and client buffers


def test_the_dockerignore_keeps_secrets_and_clutter_out_of_the_image() -> None:
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and line[0] != "#"}
    assert {".git", ".env", "deploy/users.acl", ".venv", "**/__pycache__", "tests"} <= ignored
    copied = re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), flags=re.MULTILINE)
    sources = {word for line in copied for word in line.split()}
    # Every package of the library's wheel, and tools/ (the distribution with the `staging-sink` script).
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert sources == {"pyproject.toml", "README.md", "tools", *packages["packages"]} and not sources & ignored


def test_valkey_runs_the_durable_config_with_a_healthcheck() -> None:
    valkey = compose()["services"]["valkey"]
    assert re.fullmatch(r"valkey/valkey:8\.\d+\.\d+", valkey["image"])
    assert command_words(valkey) == ["valkey-server", "/etc/valkey/valkey.conf"]
    mounts = {volume.split(":")[0]: volume.split(":")[1] for volume in valkey["volumes"]}
    assert mounts["./deploy/valkey.conf"] == "/etc/valkey/valkey.conf"
    assert mounts["./deploy/users.acl"] == valkey_conf()["aclfile"] == "/etc/valkey/users.acl"
    assert {name: valkey_conf().get(name) for name in REQUIRED_CONFIG} == REQUIRED_CONFIG
    check = " ".join(valkey["healthcheck"]["test"])
    assert "valkey-cli" in check and "--user ops" in check and "ping" in check
    assert valkey["environment"]["REDISCLI_AUTH"].startswith(f"${{{password_env_var('ops')}:?")
    assert all(port.startswith("127.0.0.1:") for port in valkey.get("ports", []))


@pytest.mark.parametrize("name", sorted(SERVICE_ROLES))
def test_each_application_service_runs_a_known_subcommand_as_its_role(name: str) -> None:
    service = compose()["services"][name]
    words = command_words(service)
    assert words[:1] == ["staging-sink"] and words[1] in COMPOSE_SUBCOMMANDS, words
    assert service["depends_on"]["valkey"]["condition"] == "service_healthy"
    assert service["build"]["context"] == "."
    url = service["environment"]["STAGING_SINK_REDIS_URL"]  # the CLI's default --redis-url
    role = SERVICE_ROLES[name]
    assert role in ROLE_NAMES
    assert url.startswith(f"redis://{role}:${{{password_env_var(role)}:?") and url.endswith("@valkey:6379")
    if name in ("demo-worker", "capture-proxy"):  # both also play the gate, which has its own user
        gate_url = service["environment"]["STAGING_SINK_GATE_REDIS_URL"]
        assert gate_url.startswith(f"redis://gate:${{{password_env_var('gate')}:?")
    if name == "demo-worker":
        assert service["restart"] == "no"  # one step, then it exits: never restarted forever


def test_setup_and_prune_run_as_admin_and_every_service_waits_for_setup() -> None:
    services = compose()["services"]
    for name, subcommand in ADMIN_SERVICES.items():
        service = services[name]
        assert command_words(service)[:2] == ["staging-sink", subcommand]
        url = service["environment"]["STAGING_SINK_REDIS_URL"]
        assert url.startswith(f"redis://{ADMIN_ROLE}:${{{password_env_var(ADMIN_ROLE)}:?") and url.endswith("@valkey:6379")
    # On Valkey the roles may only FCALL the function library: nothing stages before `setup` loaded it.
    for name in (*SERVICE_ROLES, "prune"):
        assert services[name]["depends_on"]["setup"]["condition"] == "service_completed_successfully", name


def test_the_cli_reads_the_urls_compose_sets() -> None:
    from sink_cli.dispatch import ENV_GATE_REDIS_URL, ENV_REDIS_URL, build_parser

    env = {ENV_REDIS_URL: "redis://worker:pw@valkey:6379", ENV_GATE_REDIS_URL: "redis://gate:pw@valkey:6379"}
    demo = build_parser(env).parse_args(command_words(compose()["services"]["demo-worker"])[1:])
    assert (demo.redis_url, demo.gate_redis_url, demo.role) == (env[ENV_REDIS_URL], env[ENV_GATE_REDIS_URL], "worker")
    for name in ("assembler", "trainer", "metrics", "capture-proxy"):
        args = build_parser(env).parse_args(command_words(compose()["services"][name])[1:])
        assert args.redis_url == env[ENV_REDIS_URL], name


def test_the_dockerfile_installs_the_metrics_extra() -> None:
    text = DOCKERFILE.read_text()
    assert text.startswith("#") and "FROM python:3.11." in text
    assert 'pip install ".[metrics,proxy,parquet]" ./tools' in text and "USER " in text


def test_the_acl_example_is_rendered_from_the_role_table() -> None:
    assert ACL_EXAMPLE.read_text() == render_acl_example(server_version="8.0")


def write_acl_with_the_cli(acl: Path, env: Path, capsys: pytest.CaptureFixture[str], *options: str) -> None:
    """What deploy/README.md runs: ``staging-sink acl --env-file .env [--admin] > deploy/users.acl``."""
    capsys.readouterr()
    assert main(["acl", "--env-file", str(env), *options]) == 0
    acl.write_text(capsys.readouterr().out)


def test_the_acl_cli_writes_the_acl_and_a_private_env_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acl, env = tmp_path / "users.acl", tmp_path / ".env"
    write_acl_with_the_cli(acl, env, capsys)
    passwords = dict(line.split("=", 1) for line in env.read_text().splitlines())
    assert set(passwords) == {password_env_var(role) for role in ROLE_NAMES}
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert acl.read_text().startswith("user default off")
    assert not any(password in acl.read_text() for password in passwords.values())


@pytest.mark.anyio
async def test_deploy_config_and_acl_run_on_valkey_with_a_working_healthcheck(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy/valkey.conf (bind, port and dir aside) with a CLI-made ACL: the worker sees a durable server
    and the compose healthcheck passes with the ops password and fails with a wrong one."""
    binary = require_binary("valkey-server")
    cli = shutil.which("valkey-cli")
    if cli is None:
        skip_or_fail("valkey-cli is not installed (valkey-tools)")
    acl, env = tmp_path / "users.acl", tmp_path / ".env"
    write_acl_with_the_cli(acl, env, capsys, "--admin")
    by_var = dict(line.split("=", 1) for line in env.read_text().splitlines())
    passwords = {role: by_var[password_env_var(role)] for role in (*ROLE_NAMES, ADMIN_ROLE)}
    config = {k: v for k, v in valkey_conf().items() if k not in ("bind", "port", "dir")} | {"aclfile": str(acl)}
    with AclServer(passwords=passwords, binary=binary, data_dir=tmp_path / "data", extra_config=config) as server:
        async with aioredis.Redis.from_url(server.role_url("worker")) as worker:
            report = await verify_durability([worker])
        assert report.problem is None and report.supports_waitaof
        healthcheck = compose()["services"]["valkey"]["healthcheck"]["test"][1]
        command = healthcheck.replace("$$", "$").replace("-p 6379", f"-p {server.port}")
        assert f"-p {server.port}" in command
        for password, healthy in ((passwords["ops"], True), ("wrong", False)):
            environment = {**os.environ, "REDISCLI_AUTH": password, "PATH": f"{Path(cli).parent}:/bin:/usr/bin"}
            with anyio.fail_after(30):
                done = await anyio.run_process(["sh", "-c", command], env=environment, check=False)
            assert (done.returncode == 0) is healthy, (password == "wrong", done.stdout, done.stderr)
