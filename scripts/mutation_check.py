"""A small mutation runner (issue 13's mutation check), standing in for mutmut/cosmic-ray, which the shared
venv does not have. Run from the worktree root:

    python scripts/mutation_check.py TARGET [TARGET ...] [--json out.json]

Each target mutates one file (Python by AST: comparison and boolean operators, ``not``, small integer
constants, ``True``/``False``, ``min``/``max``; Lua inside the staging script by text: comparisons and
``1``/``0``), runs the target's tests for every mutant (``pytest -x``, 120 s cap) and restores the file.
A mutant is *killed* when the tests fail, *survived* otherwise. The file is restored from a copy even
if the run is interrupted.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable


@dataclass(frozen=True)
class Target:
    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()  # empty: the whole module
    lua_constant: str | None = None  # mutate the Lua text of this module-level string instead


TARGETS: dict[str, Target] = {
    "durability": Target(
        "sink/store/durability.py",
        (
            "tests/test_hardening_durability.py",
            "tests/test_sink.py::test_a_non_durable_server_is_refused_naming_the_setting",
        ),
    ),
    "confirmation": Target(
        "sink/store/commit.py",
        (
            "tests/test_hardening_durability.py",
            "tests/test_reliability_failover.py",
            "-k",
            "not cluster and not killing",
        ),
        functions=("_confirmation_error", "_write_node_once"),
    ),
    "stage_script": Target(
        "sink/store/scripts.py",
        ("tests/test_sink.py", "tests/test_hardening_lifecycle.py", "tests/test_hardening_repair.py", "-k", "valkey"),
        lua_constant="_STAGE",
    ),
    "verify": Target("sink/trainer/verify.py", ("tests/test_verify.py",)),
    "gate": Target("sink/ledger/gate.py", ("tests/test_gate.py", "tests/test_hardening_isolation.py")),
    "ownership": Target("sink/ledger/ownership.py", ("tests/test_hardening_isolation.py", "tests/test_ledger.py")),
    "acl": Target(
        "sink/ops/acl.py",
        ("tests/test_acl.py", "tests/test_hardening_functions.py", "tests/test_hardening_roles.py"),
    ),
    "generation_cut": Target("worker/generation_cut.py", ("tests/test_worker_generation_cut.py",)),
}

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


def _in_scope(tree: ast.Module, functions: tuple[str, ...]) -> list[ast.AST]:
    if not functions:
        return [tree]
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in functions
    ]


def _docstring_nodes(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def python_mutants(source: str, functions: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """``(description, mutated source)`` for every mutation point in scope."""
    tree = ast.parse(source)
    points: list[tuple[int, str]] = []
    skip = _docstring_nodes(tree)
    nodes = [n for scope in _in_scope(tree, functions) for n in ast.walk(scope)]
    for index, node in enumerate(nodes):
        if isinstance(node, ast.Compare):
            points += [(index, f"cmp{k}") for k, op in enumerate(node.ops) if type(op) in _COMPARE_SWAPS]
        elif isinstance(node, ast.BoolOp):
            points.append((index, "boolop"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            points.append((index, "not"))
        elif isinstance(node, ast.Constant) and id(node) not in skip:
            if isinstance(node.value, bool) or (isinstance(node.value, int) and abs(node.value) <= 1_000_000):
                points.append((index, "const"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            points.append((index, "minmax"))
    for index, kind in points:
        mutated_tree = ast.parse(source)
        mutated_nodes = [n for scope in _in_scope(mutated_tree, functions) for n in ast.walk(scope)]
        node = mutated_nodes[index]
        line = getattr(node, "lineno", "?")
        if kind.startswith("cmp"):
            assert isinstance(node, ast.Compare)
            k = int(kind[3:])
            old = type(node.ops[k])
            node.ops[k] = _COMPARE_SWAPS[old]()
            what = f"{old.__name__}->{type(node.ops[k]).__name__}"
        elif kind == "boolop":
            assert isinstance(node, ast.BoolOp)
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            what = "and<->or"
        elif kind == "not":
            assert isinstance(node, ast.UnaryOp)
            what = "drop not"
            node = _drop_not(mutated_tree, node)
        elif kind == "const":
            assert isinstance(node, ast.Constant)
            old_value = node.value
            node.value = (not old_value) if isinstance(old_value, bool) else old_value + 1
            what = f"{old_value!r}->{node.value!r}"
        else:
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            old_name = node.func.id
            node.func.id = "max" if old_name == "min" else "min"
            what = f"{old_name}->{node.func.id}"
        yield f"line {line}: {what}", ast.unparse(mutated_tree)


def _drop_not(tree: ast.Module, target: ast.UnaryOp) -> ast.AST:
    class Dropper(ast.NodeTransformer):
        def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
            self.generic_visit(node)
            return node.operand if node is target else node

    Dropper().visit(tree)
    return target


_LUA_SWAPS = [
    (" == ", " ~= "),
    (" ~= ", " == "),
    (" < ", " <= "),
    (" > ", " >= "),
    (" 1 ", " 0 "),
    ("== 1", "== 0"),
    (" or ", " and "),
    (" and ", " or "),
]


def lua_mutants(source: str, constant: str) -> Iterator[tuple[str, str]]:
    match = re.search(rf'^{constant}(?:: [^=]+)? = """\n(.*?)"""', source, re.DOTALL | re.MULTILINE)
    assert match is not None, constant
    start, end = match.span(1)
    body = source[start:end]
    for line_no, line in enumerate(body.splitlines(keepends=True)):
        if line.lstrip().startswith("--"):
            continue
        for old, new in _LUA_SWAPS:
            position = line.find(old)
            while position >= 0:
                mutated_line = line[:position] + new + line[position + len(old) :]
                lines = body.splitlines(keepends=True)
                lines[line_no] = mutated_line
                yield (
                    f"lua line {line_no + 1}: {old.strip()}->{new.strip()}",
                    source[:start] + "".join(lines) + source[end:],
                )
                position = line.find(old, position + 1)


def run_target(name: str, target: Target, root: Path) -> dict[str, object]:
    path = root / target.path
    original = path.read_text()
    backup = path.with_suffix(path.suffix + ".orig")
    shutil.copyfile(path, backup)
    mutants = (
        list(lua_mutants(original, target.lua_constant))
        if target.lua_constant
        else list(python_mutants(original, target.functions))
    )
    survivors: list[str] = []
    killed = 0
    started = time.monotonic()
    try:
        for description, text in mutants:
            path.write_text(text)
            try:
                done = subprocess.run(
                    [PY, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "timeout=30", *target.tests],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    timeout=180,
                    check=False,
                )
                dead = done.returncode != 0
            except subprocess.TimeoutExpired:
                dead = True
            if dead:
                killed += 1
            else:
                survivors.append(description)
            print(f"{name}: {'killed  ' if dead else 'SURVIVED'} {description}", flush=True)
    finally:
        shutil.copyfile(backup, path)
        backup.unlink()
    return {
        "target": name,
        "file": target.path,
        "mutants": len(mutants),
        "killed": killed,
        "survived": survivors,
        "seconds": round(time.monotonic() - started),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("targets", nargs="+", choices=sorted(TARGETS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--with-tests", action="append", default=[], help="more test files for every target")
    args = parser.parse_args()
    root = Path.cwd()
    targets = {name: TARGETS[name] for name in args.targets}
    if args.with_tests:
        targets = {
            name: Target(t.path, (*args.with_tests, *t.tests), t.functions, t.lua_constant)
            for name, t in targets.items()
        }
    results = [run_target(name, target, root) for name, target in targets.items()]
    for result in results:
        print(
            f"{result['target']}: {result['mutants']} mutants, {result['killed']} killed, {len(result['survived'])} survived"
        )  # type: ignore[arg-type]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
