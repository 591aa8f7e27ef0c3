"""Outcomes are types, checked on the source: a Lua script's status is compared through its IntEnum
(:mod:`sink.store.scripts.status`), never as a bare number, and a skip code is a :class:`SkipCode` member, never a
bare string, anywhere in ``sink`` or ``worker``.

Each rule is a function over a source root, so the tests also run it on a small broken tree and check it fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sink.contract.skip_codes import SkipCode

ROOT = Path(__file__).resolve().parents[1]
SKIP_CODES_HOME = "sink/contract/skip_codes.py"
# A script's reply, or a status read out of one: the names the store and its callers give them.
_STATUS_NAMES = re.compile(r"reply|^status$|^state$", re.IGNORECASE)
_EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _sources(root: Path, packages: tuple[str, ...]) -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(root).as_posix(), ast.parse(path.read_text(), filename=str(path)))
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    ]


def _int_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Tuple | ast.Set | ast.List) and node.elts:
        return all(_int_literal(element) for element in node.elts)
    return False


def _names_a_status(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and _STATUS_NAMES.search(n.id) for n in ast.walk(node))


def bare_status_comparisons(root: Path) -> list[str]:
    """``reply[0] == 2``, ``status in (0, 1)``, ...: a script status (the Lua scripts run only from ``sink``)
    compared for equality with a number instead of an enum member. Order comparisons (counts) are not statuses."""
    found: list[str] = []
    for relative, tree in _sources(root, ("sink",)):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not all(isinstance(op, _EQUALITY) for op in node.ops):
                continue
            operands = [node.left, *node.comparators]
            if any(_int_literal(o) for o in operands) and any(_names_a_status(o) for o in operands):
                found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    return found


def bare_skip_codes(root: Path) -> list[str]:
    """A string literal equal to a skip code outside its one home (use the :class:`SkipCode` member)."""
    codes = {code.value for code in SkipCode}
    found: list[str] = []
    for relative, tree in _sources(root, ("sink", "worker", "tools/sink_tools", "tools/sink_cli")):
        if relative == SKIP_CODES_HOME:
            continue
        found += [
            f"{relative}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in codes
        ]
    return found


RULES = {"script statuses": bare_status_comparisons, "skip codes": bare_skip_codes}
BREAKS = {  # rule -> a module that breaks it
    "script statuses": "def f(reply: list[int]) -> bool:\n    return reply[0] == 2\n",
    "skip codes": "def f(code: str) -> bool:\n    return code == 'stale_weights'\n",
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_tree_obeys(rule: str) -> None:
    problems = RULES[rule](ROOT)
    assert not problems, f"{rule}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_rule_fails_on_a_broken_tree(rule: str, tmp_path: Path) -> None:
    for package in ("sink", "worker", "tools/sink_tools", "tools/sink_cli"):
        (tmp_path / package).mkdir(parents=True)
    (tmp_path / "sink" / "broken.py").write_text(BREAKS[rule])
    assert RULES[rule](tmp_path) == [f"sink/broken.py:2: {_expected(rule)}"]


def _expected(rule: str) -> str:
    return "reply[0] == 2" if rule == "script statuses" else "'stale_weights'"


def test_every_skip_code_is_a_distinct_string() -> None:
    assert len({code.value for code in SkipCode}) == len(SkipCode)
    assert str(SkipCode.STALE_WEIGHTS) == "stale_weights" and f"{SkipCode.MISSING_RECORD}" == "missing_record"
