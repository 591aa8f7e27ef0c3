"""The docs' commands match the CLI: every ``staging-sink`` command line in README, ``docs/``, ``deploy/README.md``
and CONTRIBUTING (code blocks and inline code) parses with the real parser, its ``--help`` works, the safe ones run
against a real server, install lines say how this package is installed (from a clone, not from PyPI), and every
command, metric, exit code and ACL role the code has is documented somewhere in ``docs/``."""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sink_cli.dispatch import build_parser
from sink_cli.main import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "deploy" / "README.md", *PAGES]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
PLACEHOLDERS = {
    "R": "r1",
    "ROLLOUT": "r1",
    "S": "1",
    "N": "1",
    "PATH": "out.jsonl",
    "URL": "redis://127.0.0.1:6379",
    "NAME": "trainer",
}
BENCHES = ("codec", "stage", "worker", "assembly", "trainer", "ack", "groups", "gym", "proxy")


def _command_texts(paths: list[Path]) -> list[str]:
    """Every ``staging-sink ...`` command in *paths*: code-block lines (comments cut) and inline code spans."""
    found: list[str] = []
    for text in (path.read_text() for path in paths):
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL):
            for line in block.splitlines():
                command = re.split(r"\s#", line)[0].strip()
                command = re.sub(r"^(\S*/)?(staging-sink )", r"\2", command.split("&& ")[-1])
                if command.startswith("staging-sink "):
                    found.append(command)
        found += [m.replace("\\|", "|") for m in re.findall(r"`(staging-sink [^`]*)`", text)]
    return sorted(set(found))


def _variants(text: str) -> list[list[str]]:
    """The argv lists a documented command stands for: alternatives ``a|b`` expanded, optional ``[...]`` parts
    included, repetition marks dropped, placeholders filled, a shell redirect cut off."""
    text = text.split(" > ")[0].replace("…", "").replace("...", "")
    text = re.sub(r"\[([^\]]*)\]", r"\1", text)
    choices = [word.split("|") for word in text.split()[1:]]
    if choices and choices[0] == ["bench"] and len(choices) > 1 and choices[1] == ["NAME"]:
        choices[1] = list(BENCHES)
    return [
        [_fill(word, combo[i - 1] if i else "") for i, word in enumerate(combo)]
        for combo in itertools.product(*choices)
    ]


def _fill(word: str, before: str) -> str:
    return "staging" if before == "--state" else PLACEHOLDERS.get(word, word)


COMMANDS = _command_texts(DOCS)
ARGVS = sorted({tuple(argv) for text in COMMANDS for argv in _variants(text)})


def test_the_docs_show_commands() -> None:
    assert len(COMMANDS) >= 20 and any(argv[:1] == ("proxy",) for argv in ARGVS)
    assert any(argv[:1] == ["proxy"] for text in _command_texts([ROOT / "README.md"]) for argv in _variants(text))


@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_every_documented_command_parses_and_has_help(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    if argv and argv[0] == "bench":  # bench hands its arguments to the benchmark's own parser
        assert argv[1] in BENCHES, argv
    elif argv and not argv[0].startswith("-"):
        try:
            build_parser().parse_args(list(argv))
        except SystemExit:
            # A bare mention (`staging-sink proxy`) may omit a required option; nothing the docs show may be
            # unknown to the CLI.
            error = capsys.readouterr().err
            assert "unrecognized arguments" not in error and "invalid choice" not in error, error
            assert "the following arguments are required" in error, error
    path = [word for word in argv[:2] if not word.startswith("-")]
    path = path[:1] if path[:1] != ["bench"] else path
    with pytest.raises(SystemExit) as exited:
        main([*path, "--help"] if argv[:1] != ("--version",) else ["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.strip()


SAFE = [["stats"], ["list"], ["prune", "--dry-run"], ["prune", "--dry-run", "--json"]]


@pytest.mark.parametrize("argv", SAFE, ids=" ".join)
def test_the_safe_documented_commands_run_against_a_real_server(argv: list[str], redis_url: str) -> None:
    assert tuple(argv) in ARGVS or any(a[: len(argv)] == tuple(argv) for a in ARGVS), argv
    assert main([*argv, "--redis-url", redis_url]) == 0


def test_install_lines_say_how_to_install_from_this_repository() -> None:
    for path in DOCS:
        text = path.read_text()
        pypi = re.findall(r"pip install 'staging-sink\[[a-z,]+\]'", text)  # the VCS form has " @ git+" inside
        assert not pypi, f"{path.name}: {pypi}: install from a clone or pip's VCS form, not from PyPI"
        for extras in re.findall(r"pip install -e '\.\[([a-z,]+)\]'", text):
            assert set(extras.split(",")) <= EXTRAS, (path.name, extras)
    assert "numpy` extra" not in README  # numpy is a default dependency


def test_the_vllm_section_starts_the_server_on_the_port_it_exports() -> None:
    section = README.split("## Use it with vLLM")[1].split("\n## ")[0]
    port = re.search(r"export STAGING_SINK_REDIS_URL=redis://127\.0\.0\.1:(\d+)", section)
    assert port and f"staging-sink server --port {port.group(1)}" in section


@pytest.mark.parametrize("bench", ["trainer", "proxy"])
def test_bench_help_shows_the_defaults(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", bench, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    expected = {
        "trainer": ["(default: 64)", "(default: 32)", "(default: 2048)", "(default: 3)"],
        "proxy": ["(default: [1, 16, 64])", "(default: 2048)", "(default: 8)", "(default: 50)"],
    }[bench]
    assert all(text in out for text in expected), out


def test_proxy_and_delete_help_say_what_the_commands_do(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    proxy = " ".join(capsys.readouterr().out.split())
    cluster = re.search(r"--cluster, --no-cluster (.*?) --", proxy)
    assert cluster and "proxy" in cluster.group(1), proxy  # the proxy does not detect the mode
    with pytest.raises(SystemExit):
        main(["delete", "--help"])
    delete = " ".join(capsys.readouterr().out.split())
    assert "every key" in delete and "staged records" in delete


def test_the_function_library_name_has_the_documented_form() -> None:
    from sink.store.scripts import LIBRARY

    assert any("`staging_sink_<hash>`" in path.read_text() for path in PAGES)
    assert re.fullmatch(r"staging_sink_[0-9a-f]{12}", LIBRARY.name), LIBRARY.name


# --- everything the code has is documented somewhere in docs/ --------------------------------------------

DOCS_TEXT = "\n".join(page.read_text() for page in PAGES)


def test_every_command_and_benchmark_is_documented_in_docs(capsys: pytest.CaptureFixture[str]) -> None:
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    documented = {argv[0] for text in _command_texts(PAGES) for argv in _variants(text) if argv}
    # A table row may name several commands: `staging-sink inspect R` / `verify R` / `tail R`.
    for row in re.findall(r"^\| (`staging-sink .*?) \|", DOCS_TEXT, flags=re.MULTILINE):
        documented |= {span.removeprefix("staging-sink ").split()[0] for span in re.findall(r"`([^`]+)`", row)}
    missing = set(commands.choices) - documented
    assert not missing, f"no page of docs/ shows `staging-sink {sorted(missing)}`"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    # The list may wrap onto continuation lines (argparse fills the terminal's width).
    listed = re.search(r"^\s+NAME\s+(\S+(?:\s+\|\s+\S+)*)$", capsys.readouterr().out, flags=re.MULTILINE)
    assert listed, "bench --help names no benchmark"
    installed = set(re.split(r"\s+\|\s+", listed.group(1)))
    assert installed == set(BENCHES), installed
    # Named one by one (`staging-sink bench codec|stage|...`), not through the NAME placeholder.
    named = {name for spans in re.findall(r"staging-sink bench ([a-z|\\]+)", DOCS_TEXT) for name in spans.split("|")}
    named = {name.strip("\\") for name in named}
    assert installed <= named, sorted(installed - named)


def _proxy_series() -> set[str]:
    """The series names the capture proxy's registry declares (counters with their ``_total`` once)."""
    from worker.proxy.metrics import ProxyMetrics

    types = re.findall(r"^# TYPE (\S+) (\S+)$", ProxyMetrics().exposition().decode(), flags=re.MULTILINE)
    return {f"{name.removesuffix('_total')}_total" if kind == "counter" else name for name, kind in types}


def test_every_metric_series_is_documented_in_docs() -> None:
    from sink.ops.metrics.exporter import EXPORTED_METRICS

    series = {re.sub(r"_(bucket|count|sum)$", "", name) for name in EXPORTED_METRICS} | _proxy_series()
    assert "staging_proxy_calls_total" in series and "staging_sink_stages_total" in series
    missing = sorted(name for name in series if not re.search(rf"`{name}[`{{]", DOCS_TEXT))
    assert not missing, f"series no page of docs/ names: {missing}"


def test_every_exit_code_is_documented_in_docs() -> None:
    import sink_cli.common
    import sink_cli.failures

    codes = {
        value
        for module in (sink_cli.common, sink_cli.failures)
        for name, value in vars(module).items()
        if name.startswith("EXIT_") and isinstance(value, int)
    }
    assert {0, 1, 2, 3} <= codes
    rows = {int(code) for code in re.findall(r"^\| (\d+) \|", DOCS_TEXT, flags=re.MULTILINE)}
    assert codes <= rows, f"exit codes without a row in a docs/ table: {sorted(codes - rows)}"


def test_every_acl_role_has_a_row_in_the_trust_model() -> None:
    from sink.ops.access.policy import ROLE_NAMES

    trust = (ROOT / "docs" / "trust-model.md").read_text()
    rows = set(re.findall(r"^\| `([a-z_]+)`", trust, flags=re.MULTILINE))
    assert {"worker", "gym_sink", "gym_source"} <= set(ROLE_NAMES)
    assert set(ROLE_NAMES) <= rows, f"roles without a row: {sorted(set(ROLE_NAMES) - rows)}"


# --- Python programs: what README and docs tell you to run with python or pip ------------------------------

VENV = ".venv/bin/"
"""Where README's first command installs the package: a bare ``python``/``pip`` is not on a fresh Debian's PATH
(only ``python3``), has no staging-sink, and Debian's own refuses ``pip install`` (PEP 668)."""
OTHER_ENVIRONMENTS = (
    "python3 -m venv .venv",  # README's first command: it makes the venv
    "pip install 'staging-sink[",  # pip's VCS form, for an environment that is not a clone ("elsewhere")
    "python -m vllm.entrypoints.",  # vLLM's own environment
)
PROGRAM = re.compile(r"^(\S*?)(?:python3?|pip3?) ")


def _shell_commands(text: str) -> list[str]:
    """Inline code spans and the lines of code blocks that are not Python, comments cut, split at ``&&``."""
    lines = re.findall(r"`([^`\n]+)`", text)
    for language, block in re.findall(r"```([a-z]*)\n(.*?)```", text, flags=re.DOTALL):
        if language not in ("python", "py"):
            lines += block.splitlines()
    parts = (part.strip() for line in lines for part in re.split(r"\s#", line)[0].split("&&"))
    return [part for part in parts if part]


def _python_commands() -> list[tuple[str, str]]:
    """``(document, command)`` for every command in README and docs that runs ``python``/``pip``."""
    return [
        (path.relative_to(ROOT).as_posix(), command)
        for path in DOCS
        for command in _shell_commands(path.read_text())
        if PROGRAM.match(command)
    ]


PYTHON_COMMANDS = _python_commands()
EXAMPLE_COMMANDS = sorted({command for _doc, command in PYTHON_COMMANDS if " examples/" in command})


def test_every_python_and_pip_command_in_the_docs_runs_in_the_readme_venv() -> None:
    assert EXAMPLE_COMMANDS and any(doc == "docs/gym.md" for doc, _command in PYTHON_COMMANDS)
    wrong = [
        (doc, command)
        for doc, command in PYTHON_COMMANDS
        if not command.startswith(VENV) and not command.startswith(OTHER_ENVIRONMENTS)
    ]
    assert not wrong, f"run these with {VENV}python / {VENV}pip (README's venv), as every other command: {wrong}"


def _example_argv(command: str) -> list[str]:
    """The documented example command with this interpreter for ``.venv/bin/python`` (the venv it runs in)."""
    program, *args = command.split()
    assert program == f"{VENV}python", command
    return [sys.executable, *args]


@pytest.mark.parametrize("command", EXAMPLE_COMMANDS)
def test_every_example_the_docs_run_exists_and_knows_the_documented_options(command: str) -> None:
    argv = _example_argv(command)
    assert (ROOT / argv[1]).is_file(), argv[1]
    shown = subprocess.run([*argv[:2], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    unknown = [word for word in argv[2:] if word.startswith("--") and word not in shown.stdout]
    assert not unknown, (command, unknown)


@pytest.mark.slow
@pytest.mark.parametrize("command", EXAMPLE_COMMANDS)
def test_every_example_the_docs_run_works_as_written(command: str) -> None:
    """Run from the repository root, as README's commands are; its own private durable server."""
    done = subprocess.run(_example_argv(command), cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
