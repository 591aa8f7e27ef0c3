"""The architecture rules of the tree, checked on the source.

No import circles (type-only and function-level imports included), folders in a strict layer order (a module imports only its own folder and lower ones),
``sink`` never importing ``worker`` (lazily or by name), the library never importing the tools, the command line or
the command line's rich (a dependency of the tools' distribution only), no private module or name imported across packages,
the documented re-export shims used only from outside the source tree, a pure wire-contract layer, and blind
``except Exception`` only at the documented boundaries listed below.

Each rule is a function over a :class:`Tree` (parsed source), so the tests at the bottom also run every rule on a
deliberately broken copy of the tree and check that it fails.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each package's folder, from the repository root: the library's distribution here, the tools' one in tools/.
PACKAGE_DIRS = {"sink": "sink", "worker": "worker", "sink_tools": "tools/sink_tools", "sink_cli": "tools/sink_cli"}
LIBRARY = ("sink", "worker")  # what inference workers and trainers import; never the tools or the command line

# Folders from the lowest layer to the highest. A module may import modules of its own folder and of lower ones.
# Sub-folders not listed (for example sink.contract._packed) belong to the layer of their parent folder.
LAYERS: tuple[str, ...] = (
    "sink",  # the top modules every part uses: errors, keys, settings, canonical
    "sink.server",  # private durable servers
    "sink.contract",  # the wire contract: records, schema table, digests, codec, packed rows
    "sink.store",  # the connection and the staging store
    "sink.gym",  # NeMo Gym's TokenSink/TokenSource, a front end over the store
    "sink.ledger",  # the per-rollout ledger and the commit gate
    "sink.rollout",  # done event, assembler, terminal selection, receipt
    "sink.trainer",  # the reader and everything the trainer pulls
    "sink.ops",  # prune, metrics, ACL
    "worker",  # capture core
    "worker.proxy",  # the OpenAI-compatible capture proxy
    "sink_tools",  # the repository's tools: local cluster, HTML report
    "sink_tools.bench",  # benchmarks
    "sink_tools.simulated",  # the simulated engine
    "sink_tools.demo",  # the demo's worker processes and progress
    "sink_cli",  # the command line, on top of everything
)
# Facade: sink/__init__ re-exports the package; it may import anything in sink and nothing in sink imports it.
FACADES = frozenset({"sink"})
# Thin re-exports at import paths the seed documents; only code outside the source tree imports them.
SHIMS = frozenset({"sink.records", "sink.digest", "sink.protocols"})
# The wire contract: pure code, no Redis client, no event loop.
CONTRACT_MODULES = (
    "sink.canonical",
    "sink.contract.codec",
    "sink.contract.digest",
    "sink.contract.fingerprint",
    "sink.contract.packed",
    "sink.contract.records",
)
IO_LIBRARIES = ("redis", "anyio", "hiredis")
# The command line's presentation libraries: dependencies of the tools' distribution (tools/pyproject.toml), not of
# the library.
CLI_LIBRARIES = ("rich",)

# Blind handlers (``except Exception``, ``except BaseException``, bare ``except:``) allowed only here, one line why.
# Key: "path:function" (the innermost enclosing function, or "<module>"); one entry covers every blind handler of that
# function. A handler that only cleans up and re-raises (its last statement a bare ``raise``) is not blind.
# Remove an entry with its handler (a stale entry fails the test too).
BLIND_EXCEPT_BOUNDARIES: dict[str, str] = {
    "tools/sink_cli/dispatch.py:run": "the CLI top: an expected failure is one stderr line + exit code",
    "sink/store/commit.py:write_batch": "group commit: a bug must not strand waiting callers; logged",
    "sink/store/resource.py:_close_forgotten": "finalizer of an unclosed resource: best effort, logged, never raises",
    "sink/store/resource.py:run": "loop thread: a startup failure goes to the waiting constructor",
    "sink/trainer/verify.py:_verify_snapshot": "a failed digest recompute becomes a typed error, chained",
    "sink/trainer/reader/sync_reader.py:_answer": "a DataLoader worker's acknowledgement: its error goes to the loading "
    "process, whose ack() raises it",
    "tools/sink_tools/demo/worker_process.py:worker_process_main": "demo worker process: failure sent to the parent",
    "worker/proxy/app.py:__call__": "ASGI lifespan startup: the failure is reported to the server, which exits",
    "worker/proxy/captured_call.py:run": "per captured call: a bug is logged with its traceback, the call recorded "
    "failed, then fail-open serves the stripped reply, fail-closed answers 503",
}


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True)
class Import:
    target: str  # the imported module (resolved, inside the tree)
    names: tuple[str, ...]  # names imported from it (empty for ``import x`` or a submodule)
    line: int


@dataclass
class Tree:
    """The parsed source of the packages under *root*."""

    root: Path
    paths: dict[str, Path] = field(default_factory=dict)
    trees: dict[str, ast.Module] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path) -> Tree:
        tree = cls(root)
        for folder in PACKAGE_DIRS.values():
            for path in sorted((root / folder).rglob("*.py")):
                name = _module_name(path.relative_to((root / folder).parent))
                tree.paths[name] = path
                tree.trees[name] = ast.parse(path.read_text(), filename=str(path))
        return tree

    def is_package(self, module: str) -> bool:
        return self.paths[module].name == "__init__.py"

    def package_of(self, module: str) -> str:
        return module if self.is_package(module) else module.rpartition(".")[0]

    def relative(self, module: str) -> str:
        return self.paths[module].relative_to(self.root).as_posix()

    def imports(self, module: str) -> Iterator[Import]:
        """Every import of *module* inside the tree: module level, ``TYPE_CHECKING``, function bodies, all."""
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.paths:
                        yield Import(alias.name, (), node.lineno)
                    else:  # ``import sink.store.x`` also imports its packages; only the leaf counts here
                        parent = alias.name.rpartition(".")[0]
                        if parent in self.paths:
                            yield Import(parent, (), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                target = self._absolute(module, node)
                if target not in self.paths:
                    continue
                names = [alias.name for alias in node.names]
                plain = tuple(n for n in names if f"{target}.{n}" not in self.paths)
                if plain or not names:
                    yield Import(target, plain, node.lineno)
                for name in names:
                    if f"{target}.{name}" in self.paths:
                        yield Import(f"{target}.{name}", (), node.lineno)

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = module.split(".") if self.is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        return ".".join([*base, node.module] if node.module else base)

    def graph(self) -> dict[str, set[str]]:
        """Module -> modules it imports. A package's ``__init__`` re-exporting its own submodules is not a circle
        with them: edges into a package from its own submodules are dropped (Python imports the package first)."""
        graph: dict[str, set[str]] = {}
        for module in self.paths:
            targets = {i.target for i in self.imports(module) if i.target != module}
            graph[module] = {t for t in targets if not (self.is_package(t) and module.startswith(t + "."))}
        return graph


def layer_of(module: str) -> int:
    """The rank of *module*'s folder in :data:`LAYERS` (the longest listed folder that contains it)."""
    best = -1
    for rank, folder in enumerate(LAYERS):
        parent = module.rpartition(".")[0] if module not in LAYERS else module
        if (parent == folder or parent.startswith(folder + ".")) and (best < 0 or len(folder) > len(LAYERS[best])):
            best = rank
    return best


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# The rules: each returns the list of violations (empty when the tree obeys it).


def import_circles(tree: Tree) -> list[str]:
    graph = tree.graph()
    state: dict[str, int] = {}
    path: list[str] = []
    found: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def layer_violations(tree: Tree) -> list[str]:
    found = []
    for module in tree.paths:
        if module in FACADES or module in SHIMS:
            continue  # checked by facade_and_shim_imports
        rank = layer_of(module)
        if rank < 0:
            found.append(f"{module}: its folder is not in LAYERS")
            continue
        for imp in tree.imports(module):
            if imp.target in FACADES or imp.target in SHIMS:
                continue  # checked by facade_and_shim_imports
            if layer_of(imp.target) > rank:
                found.append(
                    f"{tree.relative(module)}:{imp.line}: {module} ({LAYERS[rank]}) imports {imp.target} "
                    f"({LAYERS[layer_of(imp.target)]}), a higher layer"
                )
    return found


def facade_and_shim_imports(tree: Tree) -> list[str]:
    """Nothing in sink imports a facade; nothing in the tree imports a shim; facades and shims stay in sink."""
    found = []
    for module in tree.paths:
        for imp in tree.imports(module):
            if imp.target in SHIMS:
                found.append(f"{tree.relative(module)}:{imp.line}: imports the shim {imp.target}")
            elif imp.target in FACADES and module.split(".")[0] == "sink" and module not in FACADES | SHIMS:
                found.append(f"{tree.relative(module)}:{imp.line}: imports the facade {imp.target}")
            if module in FACADES | SHIMS and imp.target.split(".")[0] != "sink":
                found.append(f"{tree.relative(module)}:{imp.line}: facade/shim imports {imp.target}")
    return found


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_][A-Za-z0-9_.]*)?(:[A-Za-z_]\w*)?$")


def _reaches(tree: Tree, sources: tuple[str, ...], targets: tuple[str, ...], what: str) -> list[str]:
    """Modules of the *sources* packages that import one of *targets*: at the top, in a function, or by name
    (a string such as ``import_module``'s)."""
    found: list[str] = []
    for module, parsed in tree.trees.items():
        if module.split(".")[0] not in sources:
            continue
        for node in ast.walk(parsed):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
                names = [node.value] if _MODULE_NAME.match(node.value) else []
            else:
                continue
            found.extend(
                f"{tree.relative(module)}:{node.lineno}: {what} ({name})"
                for name in names
                if name.split(".")[0].split(":")[0] in targets
            )
    return found


def sink_to_worker(tree: Tree) -> list[str]:
    """``sink`` never imports ``worker``: not at the top, not in a function, not by name (``import_module``)."""
    return _reaches(tree, ("sink",), ("worker",), "sink reaches worker")


def library_to_tools(tree: Tree) -> list[str]:
    """The library (``sink``, ``worker``) never imports the tools or the command line, not even by name."""
    return _reaches(tree, LIBRARY, ("sink_tools", "sink_cli"), "the library reaches the tools or the command line")


def library_to_cli_libraries(tree: Tree) -> list[str]:
    """The library never imports the command line's presentation libraries (rich), not even by name: an install of
    the library alone is a working library."""
    return _reaches(tree, LIBRARY, CLI_LIBRARIES, "the library reaches a presentation library of the command line")


def private_imports(tree: Tree) -> list[str]:
    """No module or name starting with ``_`` imported from another package."""
    found = []
    for module in tree.paths:
        package = tree.package_of(module)
        where = f"{tree.relative(module)}"
        for imp in tree.imports(module):
            parts = imp.target.split(".")
            private = [i for i, part in enumerate(parts) if _is_private(part)]
            if private:
                owner = ".".join(parts[: private[0]])
                if not (module == owner or module.startswith(owner + ".")):
                    found.append(f"{where}:{imp.line}: imports the private module {imp.target}")
            owner_package = tree.package_of(imp.target)
            found.extend(
                f"{where}:{imp.line}: imports the private name {imp.target}.{name} from another package"
                for name in imp.names
                if _is_private(name) and owner_package != package
            )
    return found


def _is_blind(handler: ast.ExceptHandler) -> bool:
    """A handler catching everything, unless it only cleans up and re-raises (its last statement a bare ``raise``)."""
    if handler.body and isinstance(handler.body[-1], ast.Raise) and handler.body[-1].exc is None:
        return False
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in ("Exception", "BaseException") for k in kinds)


def blind_handlers(tree: Tree) -> dict[str, int]:
    """Number of blind handlers per "path:function"."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, function: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.ExceptHandler) and _is_blind(child):
                key = f"{path}:{function}"
                found[key] = found.get(key, 0) + 1
            walk(child, name, path)

    for module, parsed in tree.trees.items():
        walk(parsed, "<module>", tree.relative(module))
    return found


def blind_except_violations(tree: Tree, allowed: dict[str, str] = BLIND_EXCEPT_BOUNDARIES) -> list[str]:
    found = blind_handlers(tree)
    problems = [f"{key}: blind except outside the documented boundaries" for key in sorted(set(found) - set(allowed))]
    problems += [
        f"{key}: listed as a boundary but has no blind except (remove it)" for key in sorted(set(allowed) - set(found))
    ]
    return problems


def contract_io(tree: Tree) -> list[str]:
    """records, digest, fingerprint, codec, packed: pure code, importable without Redis or an event loop."""
    found: list[str] = []
    graph = tree.graph()
    for module in CONTRACT_MODULES:
        seen: set[str] = set()
        todo = [module]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            for node in tree.trees[current].body:  # module-level (runtime) imports of outside libraries
                if isinstance(node, ast.Import):
                    external = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    external = [node.module or ""]
                else:
                    continue
                found.extend(
                    f"{current} (reached from {module}) imports {name}"
                    for name in external
                    if name.split(".")[0] in IO_LIBRARIES
                )
            todo.extend(t for t in graph[current] if t.startswith("sink"))
    return found


RULES = {
    "import circles": import_circles,
    "layer order": layer_violations,
    "facades and shims": facade_and_shim_imports,
    "sink never imports worker": sink_to_worker,
    "the library never imports the tools or the command line": library_to_tools,
    "the library never imports the presentation libraries": library_to_cli_libraries,
    "private imports": private_imports,
    "blind except": blind_except_violations,
    "contract does no io": contract_io,
}


@pytest.fixture(scope="module")
def tree() -> Tree:
    """The parsed tree, once per worker that runs these tests (not at import: every worker imports this module)."""
    return Tree.load(ROOT)


def test_the_module_list_covers_the_tree(tree: Tree) -> None:
    assert {"sink", "sink.contract.records", "sink.contract.digest", "worker", "worker.capture"} <= set(tree.paths)


def test_every_folder_has_a_layer(tree: Tree) -> None:
    assert all(layer_of(module) >= 0 for module in tree.paths)
    assert layer_of("sink.errors") < layer_of("sink.contract.records") < layer_of("sink_cli.main")
    assert layer_of("sink.contract._packed.rows") == layer_of("sink.contract.packed")


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_tree_obeys(rule: str, tree: Tree) -> None:
    problems = RULES[rule](tree)
    assert not problems, f"{rule}:\n  " + "\n  ".join(problems)


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _pyproject(folder: Path) -> dict[str, Any]:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_the_library_wheel_holds_the_library_and_the_tools_wheel_the_rest() -> None:
    """Two distributions: the library (``sink``, ``worker``: what inference workers and trainers install) and, above
    it, the tools with the ``staging-sink`` command line, which depends on the library of the same version and on
    rich. Each wheel packages exactly its folders of :data:`PACKAGE_DIRS`; rich is in no dependency or extra of the
    library but ``dev`` (whose tests run the command line from this tree)."""
    library, tools = _pyproject(ROOT), _pyproject(ROOT / "tools")
    library_packages = library["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    tools_packages = tools["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert library_packages == list(LIBRARY)
    assert [f"tools/{package}" for package in tools_packages] == [
        folder for package, folder in PACKAGE_DIRS.items() if package not in LIBRARY
    ]
    project, extras = library["project"], library["project"]["optional-dependencies"]
    assert "scripts" not in project and not _names(project["dependencies"]) & set(CLI_LIBRARIES)
    assert [name for name, extra in extras.items() if _names(extra) & set(CLI_LIBRARIES)] == ["dev"]
    pinned = f"{project['name']}=={project['version']}"
    assert pinned in tools["project"]["dependencies"] and set(CLI_LIBRARIES) <= _names(tools["project"]["dependencies"])
    assert tools["project"]["scripts"] == {"staging-sink": "sink_cli.main:main"}


# Each rule fails on a deliberately broken copy of the tree.
BREAKS: dict[str, tuple[str, str]] = {  # rule -> (module file to edit, text appended to it)
    "import circles": ("sink/errors.py", "\ndef _late() -> None:\n    from sink.store import connection  # noqa\n"),
    "layer order": ("sink/store/connection.py", "\nif False:\n    from sink.trainer import reader\n"),
    "facades and shims": ("sink/store/connection.py", "\nfrom sink.records import StagedCall  # noqa\n"),
    "sink never imports worker": ("sink/ops/prune.py", "\nMODULE = 'worker.capture'\n"),
    "the library never imports the tools or the command line": (
        "worker/proxy/app.py",
        "\ndef _late() -> None:\n    import sink_cli.main  # noqa\n",
    ),
    "the library never imports the presentation libraries": (
        "sink/trainer/batch.py",
        "\ndef _late() -> None:\n    from rich.table import Table  # noqa\n",
    ),
    "private imports": ("sink/trainer/row.py", "\nfrom sink.store.connection import _hidden  # noqa\n"),
    "blind except": (
        "sink/keys.py",
        "\ndef _f() -> None:\n    try:\n        pass\n    except Exception:\n        pass\n",
    ),
    "contract does no io": ("sink/contract/codec.py", "\nimport redis  # noqa\n"),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_rule_fails_on_a_broken_tree(rule: str, tree: Tree) -> None:
    """The real tree with one module's source broken (parsed again with the text appended; the rules read only
    the parsed trees)."""
    relative, text = BREAKS[rule]
    module = _module_name(Path(relative))
    broken = Tree(tree.root, dict(tree.paths), dict(tree.trees))
    broken.trees[module] = ast.parse(tree.paths[module].read_text() + text, filename=relative)
    assert not RULES[rule](tree), "the real tree must obey the rule first"
    assert RULES[rule](broken), f"{rule!r} did not notice the break"
