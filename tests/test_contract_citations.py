"""Every contract citation resolves in docs/contract.md, the docs link to it, and no comment cites a tracker issue.

* Each section sign (a section number such as 5.5 after the sign) and each ``INV-<n>`` in ``sink/``,
  ``worker/``, ``tests/``, ``docs/``, ``README.md`` and ``CONTRIBUTING.md`` names a heading or an anchor of
  ``docs/contract.md``;
  no section sign cites another document.
* The page keeps the reference's numbering, and every module or object it names (``sink.x.y``) exists.
* Outside code blocks, README, CONTRIBUTING and the other docs link their contract references (section signs, invariants,
  "the contract", "the seed") to ``docs/contract.md``, and every such link's anchor exists.
* No Python source cites a tracker issue number: say what is meant instead.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "docs" / "contract.md"
SIGN = "\u00a7"

_SECTION_REF = re.compile(SIGN + r"\s?(\d+(?:\.\d+)*)")
_INVARIANT_REF = re.compile(r"\bINV-(\d+)\b")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
_NUMBERED_HEADING = re.compile(r"^#{2,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
_OTHER_DOCUMENT = re.compile(r"\b(?:architecture|spec|seed)(?:\.md)?\s*" + SIGN, re.IGNORECASE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# A markdown link whose target is the contract page (from README: docs/contract.md; from docs/: contract.md).
_CONTRACT_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\((?:\./)?(?:docs/)?contract\.md(#[^)\s]*)?\)")
_UNLINKED = re.compile(SIGN + r"\s?\d|\bINV-\d|\bthe contract\b|\bthe seed\b", re.IGNORECASE)
# A tracker reference: the word issue(s) and a number (anywhere), or a bare hash and a number (in a comment or a
# docstring, where it cannot be a CSS colour or other data).
_ISSUE_WORD = re.compile(r"\bissues?\s+(?:no\.?\s*)?#?\d+", re.IGNORECASE)
_ISSUE_HASH = re.compile(r"(?<![\w&#/:])#\d+\b")
_HASH_DIGIT = re.compile(r"#\d")  # what any _ISSUE_HASH match contains


class Citation(NamedTuple):
    path: Path
    line: int
    ref: str


def _scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    for folder in ("sink", "worker", "tools", "tests"):
        files.extend(sorted((ROOT / folder).rglob("*.py")))
    files.extend(sorted((ROOT / "docs").rglob("*.md")))
    return [path for path in files if ".venv" not in path.parts]


def _python_files() -> list[Path]:
    return [path for path in _scanned_files() if path.suffix == ".py"]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def section_citations(text: str) -> Iterator[tuple[int, str]]:
    """``(line, section number)`` of every section sign in *text*."""
    for match in _SECTION_REF.finditer(text):
        yield _line_of(text, match.start()), match.group(1)


def invariant_citations(text: str) -> Iterator[tuple[int, str]]:
    """``(line, "INV-<n>")`` of every invariant id in *text*."""
    for match in _INVARIANT_REF.finditer(text):
        yield _line_of(text, match.start()), f"INV-{match.group(1)}"


def _comments_and_docstrings(text: str, *, comments: bool = True) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every comment (unless *comments* is false) and every module, class and function docstring
    of a Python *text*."""
    if comments:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            docstring = (
                first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            )
            if isinstance(first, ast.Expr) and isinstance(docstring, str):
                yield first.lineno, docstring


def tracker_citations(text: str) -> Iterator[tuple[int, str]]:
    """``(line, reference)`` of every tracker issue a Python *text* cites, in line order."""
    found = [(_line_of(text, m.start()), m.group(0)) for m in _ISSUE_WORD.finditer(text)]
    # A comment is a slice of the text: none can cite "#N" where the text has no "#" before a digit (most files;
    # tokenizing is the slow part of the scan).
    for line, fragment in _comments_and_docstrings(text, comments=_HASH_DIGIT.search(text) is not None):
        found.extend((line + fragment.count("\n", 0, m.start()), m.group(0)) for m in _ISSUE_HASH.finditer(fragment))
    yield from sorted(found)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


class ContractIndex(NamedTuple):
    sections: frozenset[str]
    invariants: frozenset[str]
    anchors: frozenset[str]


def contract_index(text: str) -> ContractIndex:
    """The section numbers, invariant ids and link anchors *text* (the contract page) defines."""
    text = _FENCE.sub("", text)  # a heading inside a code block is no heading
    sections = frozenset(match.group(1) for match in _NUMBERED_HEADING.finditer(text))
    explicit = [match.group(1) for match in _ANCHOR.finditer(text)]
    invariants = frozenset(anchor.upper() for anchor in explicit if re.fullmatch(r"inv-\d+", anchor))
    slugs: list[str] = []
    seen: dict[str, int] = {}
    for match in _HEADING.finditer(text):
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.append(slug if count == 0 else f"{slug}-{count}")
    return ContractIndex(sections, invariants, frozenset((*slugs, *explicit)))


@pytest.fixture(scope="module")
def index() -> ContractIndex:
    return contract_index(CONTRACT.read_text(encoding="utf-8"))


def _all(kind: str) -> list[Citation]:
    found = []
    finder = section_citations if kind == "section" else invariant_citations
    for path in _scanned_files():
        for line, ref in finder(path.read_text(encoding="utf-8")):
            found.append(Citation(path.relative_to(ROOT), line, ref))
    return found


def _listing(citations: list[Citation]) -> str:
    return "\n".join(f"{c.path}:{c.line}: {c.ref}" for c in citations)


# --- the scanners themselves ----------------------------------------------------


def test_scanners_find_and_reject_what_they_should() -> None:
    doc = '## 5. Worker\n### 5.5 `complete_call`\n* <a id="inv-1"></a>**INV-1 x**\n```\n## 9. fenced\n```\n'
    index = contract_index(doc)
    assert index.sections == {"5", "5.5"}
    assert index.invariants == {"INV-1"}
    assert {"5-worker", "55-complete_call", "inv-1"} <= index.anchors
    assert "9-fenced" not in index.anchors
    inv = "INV-"
    text = f"see {SIGN}5.5 and {SIGN}7.2-{SIGN}7.4, {inv}1 and {inv}12"
    assert [ref for _, ref in section_citations(text)] == ["5.5", "7.2", "7.4"]
    assert [ref for _, ref in invariant_citations(text)] == [f"{inv}1", f"{inv}12"]
    assert _OTHER_DOCUMENT.search(f"(architecture {SIGN}4)")
    assert not _OTHER_DOCUMENT.search(f"(contract {SIGN}4)")
    issue = "issue"
    source = (
        f'"""Module ({issue} 13, defect 2)."""\n'
        f"x = 1  # {issue.title()} 12's gate\n"
        f'def f() -> None:\n    """See #{15}."""\n'
        f"css = 'a{{color:#137333}} b{{color: #555}}'  # 15 ms, issued 3 times, a&#39;b\n"
    )
    assert [ref for _, ref in tracker_citations(source)] == [f"{issue} 13", f"{issue.title()} 12", "#15"]


def test_the_scan_sees_the_code_citations() -> None:
    # The code cites the contract about two hundred times; a scanner that sees none proves nothing.
    assert len(_all("section")) > 150
    assert len(_all("invariant")) > 5


# --- every citation resolves ----------------------------------------------------


def test_every_section_citation_names_a_contract_heading(index: ContractIndex) -> None:
    unresolved = [c for c in _all("section") if c.ref not in index.sections]
    assert not unresolved, "sections cited but not headings of docs/contract.md:\n" + _listing(unresolved)


def test_every_invariant_citation_names_a_contract_anchor(index: ContractIndex) -> None:
    unresolved = [c for c in _all("invariant") if c.ref not in index.invariants]
    assert not unresolved, "invariants cited but not defined in docs/contract.md:\n" + _listing(unresolved)


def test_section_signs_cite_the_contract_only() -> None:
    # Another document's numbering would resolve here by accident and mean something else.
    wrong = [
        Citation(path.relative_to(ROOT), _line_of(text, m.start()), m.group(0))
        for path in _scanned_files()
        for text in [path.read_text(encoding="utf-8")]
        for m in _OTHER_DOCUMENT.finditer(text)
    ]
    assert not wrong, "section signs citing another document:\n" + _listing(wrong)


# The reference contract's numbering, kept section for section so that citations keep their meaning; the
# decisions of section 10 are numbered subsections here, and the project's own sections follow it.
# Section number -> number of its subsections in the reference contract.
REFERENCE_SUBSECTIONS = {1: 0, 2: 4, 3: 12, 4: 9, 5: 8, 6: 10, 7: 4, 8: 4, 9: 4, 10: 0}
REFERENCE_SECTIONS = frozenset(
    number
    for top, count in REFERENCE_SUBSECTIONS.items()
    for number in (str(top), *(f"{top}.{n}" for n in range(1, count + 1)))
)


def test_the_contract_keeps_the_reference_numbering(index: ContractIndex) -> None:
    assert index.invariants == {f"INV-{n}" for n in range(1, 6)}
    assert REFERENCE_SECTIONS <= index.sections
    assert {f"10.{n}" for n in range(1, 14)} <= index.sections
    assert {"11", "12", "13"} <= index.sections


def test_the_contract_headings_are_in_order() -> None:
    numbers = [m.group(1) for m in _NUMBERED_HEADING.finditer(_FENCE.sub("", CONTRACT.read_text(encoding="utf-8")))]
    keys = [tuple(int(part) for part in number.split(".")) for number in numbers]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys), "a section number is used twice"


_DOTTED_NAME = re.compile(r"`((?:sink|worker)(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    """Whether *dotted* is an importable module, or an attribute reached from the longest importable prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_contract_names_modules_and_objects_that_exist() -> None:
    # The page says where each rule lives; a module moved without the page following is caught here.
    text = CONTRACT.read_text(encoding="utf-8")
    names = sorted(set(_DOTTED_NAME.findall(text)))
    assert len(names) > 30
    missing = [name for name in names if not _resolves(name)]
    assert not missing, f"docs/contract.md names what does not exist: {missing}"
    paths = set(re.findall(r"`((?:tests|sink|worker|docs|scripts)/[\w./-]+)`", text))
    assert not [path for path in paths if not (ROOT / path).exists()], "docs/contract.md names missing files"
    assert not _resolves("sink.contract.no_such_module")
    assert not _resolves("sink.keys.no_such_function")


# --- README and docs link to the contract ------------------------------------------


def _linked_docs() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != CONTRACT),
    ]


def test_readme_and_docs_link_their_contract_references() -> None:
    unlinked = []
    for path in _linked_docs():
        text = path.read_text(encoding="utf-8")
        # Links cannot be written inside code blocks; keep line numbers by blanking, not deleting.
        prose = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        prose = _CONTRACT_LINK.sub(lambda m: " " * len(m.group(0)), prose)
        for match in _UNLINKED.finditer(prose):
            unlinked.append(Citation(path.relative_to(ROOT), _line_of(prose, match.start()), match.group(0)))
    assert not unlinked, "contract references without a link to docs/contract.md:\n" + _listing(unlinked)


def test_contract_links_land_on_an_anchor(index: ContractIndex) -> None:
    broken = []
    for path in _linked_docs():
        text = path.read_text(encoding="utf-8")
        for match in _CONTRACT_LINK.finditer(text):
            anchor = (match.group(1) or "#")[1:]
            if anchor and anchor not in index.anchors:
                broken.append(Citation(path.relative_to(ROOT), _line_of(text, match.start()), match.group(0)))
    assert not broken, "links to docs/contract.md whose anchor does not exist:\n" + _listing(broken)


def test_readme_points_to_the_contract() -> None:
    assert "](docs/contract.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


# --- no tracker issue numbers in the code ------------------------------------------


def test_no_python_source_cites_a_tracker_issue() -> None:
    cited = [
        Citation(path.relative_to(ROOT), line, ref)
        for path in _python_files()
        for line, ref in tracker_citations(path.read_text(encoding="utf-8"))
    ]
    assert not cited, "tracker issue numbers in code (say what is meant instead):\n" + _listing(cited)
