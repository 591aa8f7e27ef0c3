"""The architecture rules of the tree, checked on the source: no import cycles, no private names across packages,
a pure wire-contract layer, and ``sink`` never importing ``worker`` at import time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sink", "worker")
# The wire contract: pure code, no Redis client, no event loop (issue 12's layer 1).
CONTRACT_MODULES = (
    "sink.canonical",
    "sink.contract.codec",
    "sink.contract.digest",
    "sink.contract.fingerprint",
    "sink.contract.packed",
    "sink.contract.records",
)
IO_LIBRARIES = ("redis", "anyio", "hiredis")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Module-level imports that run on import (``if TYPE_CHECKING:`` blocks and function bodies excluded)."""
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif (
            isinstance(node, ast.If)
            and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or isinstance(node, ast.Try)
        ):
            yield from (n for n in node.body if isinstance(n, ast.Import | ast.ImportFrom))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _edges(module: str) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names imported from it) for each runtime import of *module* inside the project."""
    tree = ast.parse(MODULES[module].read_text())
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, []
            continue
        target = _absolute(module, node)
        if target not in MODULES:
            continue
        names = [alias.name for alias in node.names]
        submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES]
        yield target, [name for name in names if f"{target}.{name}" not in MODULES]
        for sub in submodules:
            yield sub, []


def _package_of(module: str) -> str:
    return module if _is_package(module) else module.rpartition(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_module_list_covers_the_tree() -> None:
    assert {"sink", "sink.contract.records", "sink.contract.digest", "worker", "worker.capture"} <= set(MODULES)


def test_no_import_cycles_between_modules() -> None:
    graph = {module: {target for target, _ in _edges(module) if target != module} for module in MODULES}
    # A package's __init__ re-exporting its submodules is not a cycle with them: drop edges into a package from
    # its own submodules (Python imports the package first either way).
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not (_is_package(t) and module.startswith(t + "."))}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_imported_across_packages(module: str) -> None:
    """``_name`` (or a module under a ``_private`` package) is imported only inside the package that owns it."""
    package = _package_of(module)
    for target, names in _edges(module):
        owner = _package_of(target)
        private_parts = [i for i, part in enumerate(target.split(".")) if _is_private(part)]
        if private_parts:
            owning = ".".join(target.split(".")[: private_parts[0]])
            assert module == owning or module.startswith(owning + "."), f"{module} imports private module {target}"
        for name in names:
            if _is_private(name):
                assert owner == package, f"{module} imports private {target}.{name} from another package"


@pytest.mark.parametrize("module", CONTRACT_MODULES)
def test_the_wire_contract_layer_does_no_io(module: str) -> None:
    """records, digest, fingerprint, codec, packed: pure code, importable without touching Redis or an event loop."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        tree = ast.parse(MODULES[current].read_text())
        for node in _runtime_imports(tree):
            external = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                external = []
            for name in external:
                assert name.split(".")[0] not in IO_LIBRARIES, f"{current} (reached from {module}) imports {name}"
        todo.extend(target for target, _ in _edges(current) if target.startswith("sink"))
