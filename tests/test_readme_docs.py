"""The docs pages README links to keep README's promise: their runnable examples run as installed and print what
the page says, their configuration blocks build what they name, README links every page of docs/, and every relative
link and anchor resolves, in the Markdown files and wherever the code's comments and docstrings name a page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sink.gym import RedisTokenSink, RedisTokenSource

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "deploy" / "README.md", *PAGES]
# A runnable program is a ```python block; reference fragments (names defined elsewhere) are ```py blocks.
RUNNABLE = [
    pytest.param(page, block, id=f"{page.name}#{number}")
    for page in PAGES
    for number, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL))
]


def test_readme_links_every_docs_page() -> None:
    assert PAGES
    for page in PAGES:
        assert f"(docs/{page.name}" in README, f"README does not link docs/{page.name}"
    assert "(CONTRIBUTING.md" in README


@pytest.mark.parametrize(("page", "program"), RUNNABLE)
def test_every_runnable_docs_example_runs(page: Path, program: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(program)
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Each print(...) whose line ends with a "# <output>" comment must print exactly that.
    expected = re.findall(r"^\s*print\(.*\)\s+#\s+(.+)$", program, flags=re.MULTILINE)
    assert result.stdout.splitlines() == expected, (result.stdout, expected)


def test_the_gym_config_builds_the_sink_and_source_it_names() -> None:
    blocks = [
        block
        for text in (README, (ROOT / "docs" / "gym.md").read_text())
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
        if "token_id_capture" in block
    ]
    assert len(blocks) == 2  # README's and the walk-through's
    for block in blocks:
        capture = yaml.safe_load(block)["token_id_capture"]
        assert capture["sink"] == "sink.gym:RedisTokenSink"
        sink = RedisTokenSink(**capture["sink_kwargs"])  # builds settings only; connects on first use
        source = RedisTokenSource(**capture["sink_kwargs"])
        assert sink.settings.namespace == source.settings.namespace == capture["sink_kwargs"]["namespace"]


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives *path*'s headings (lower case, punctuation dropped, spaces as hyphens)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings} | set(
        re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text)
    )


def _resolves(base: Path, target: str) -> bool:
    """Whether *target* (``file#anchor``, ``file`` or ``#anchor``, relative to *base*'s folder) names a file that
    exists and, when it has one, an anchor of it."""
    file, _, anchor = target.partition("#")
    resolved = (base.parent / file).resolve() if file else base
    return resolved.is_file() and (not anchor or anchor in _anchors(resolved))


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    targets = [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", target)]
    assert targets or page != ROOT / "README.md"
    broken = [target for target in targets if not _resolves(page, target)]
    assert not broken, f"{page.name}: {broken}"


# A page named in code: README.md, CONTRIBUTING.md or docs/<page>.md, with an optional #anchor.
_PAGE_MENTION = re.compile(r"(?<![\w/.-])((?:docs/[\w-]+|README|CONTRIBUTING)\.md)(#[\w-]+)?")


def test_every_page_and_anchor_the_code_names_exists() -> None:
    sources = [
        path
        for folder in ("sink", "worker", "tools", "tests", "examples", "scripts", "deploy")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file() and path.suffix in {".py", ".sh", ".yml", ".yaml", ".toml", ""} and ".venv" not in path.parts
    ] + [ROOT / "pyproject.toml", ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    found = [
        (path.relative_to(ROOT).as_posix(), page + anchor)
        for path in sources
        for page, anchor in _PAGE_MENTION.findall(path.read_text(errors="replace"))
    ]
    assert any(target.startswith("docs/") for _path, target in found)
    broken = [(path, target) for path, target in found if not _resolves(ROOT / "README.md", target)]
    assert not broken, f"pages or anchors named in code that do not exist: {broken}"
