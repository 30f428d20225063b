"""The package's import graph: no cycle of any kind, and the layers point one way.

Every import counts: module-level ones, lazy ones inside a function, and
those under `if TYPE_CHECKING:`. A lazy or typing-only import is still a
dependency a reader must follow, and a loop through one is a loop in the
design (it is how 28 modules ended up in four cycles before issue 30).
Importing `a.b.c` also runs the packages `a` and `a.b`, so those count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "substrax_tasks"
ROOT = "substrax_tasks"
# The backends by name: only the registry names them (as strings), and
# nothing outside a backend's own package imports it.
CONCRETE_BACKENDS = ("local", "ssh", "skypilot")
# What may sit directly in substrax_tasks/: the leaves every layer uses.
MAX_TOP_LEVEL_MODULES = 12

pytestmark = pytest.mark.unit


def modules_of(package: Path) -> dict[str, Path]:
    def name(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    return {name(p): p for p in package.rglob("*.py")}


def owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the package that `name` (a module or a name in one) is."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported(module: str, modules: dict[str, Path]) -> Iterator[str]:
    """Every module of the package that `module` imports, in any way."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            found = owner(name, modules)
            if found is None or not found.startswith(ROOT):
                continue
            # importing a.b.c runs a.b first: the packages on the way count
            parts = found.split(".")
            for n in range(2, len(parts) + 1):
                prefix = ".".join(parts[:n])
                if prefix != module and prefix in modules:
                    yield prefix


def graph_of(modules: dict[str, Path]) -> dict[str, set[str]]:
    # the package root only re-exports remote_step, lazily (PEP 562)
    return {module: set(imported(module, modules)) for module in modules if module != ROOT}


MODULES = modules_of(PACKAGE)
GRAPH = graph_of(MODULES)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def backend_package(module: str) -> str | None:
    """The concrete backend whose package holds `module`, if any."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "backends" and parts[2] in CONCRETE_BACKENDS:
        return parts[2]
    return None


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


def test_no_module_imports_a_backend_package_other_than_its_own() -> None:
    """The core (and every other backend) reaches a backend only through the
    registry, by name: adding or removing a backend touches no other package."""
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if backend_package(target) is not None and backend_package(target) != backend_package(module)
    )
    assert crossing == []


def test_the_top_level_holds_only_a_few_leaves_and_the_concept_packages() -> None:
    top = sorted(m for m, p in MODULES.items() if m.count(".") == 1 and p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    # A leaf at the top imports nothing of the concept packages below it.
    for module in top:
        above = sorted(t for t in GRAPH[module] if t.count(".") >= 1 and MODULES[t].parent != PACKAGE)
        assert above == [], f"{module} is at the top level but imports {above}"


def test_a_loop_made_only_of_lazy_and_typing_imports_is_found(tmp_path: Path) -> None:
    """The checks above count lazy and TYPE_CHECKING imports, and the packages
    an import runs on its way (shown on a package made for the test)."""
    sources = {
        "__init__.py": "",
        "errors.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from substrax_tasks.store.handle import H\n"
        ),
        "store/__init__.py": "",
        "store/handle.py": "def load():\n    from substrax_tasks import errors\n",
        "backends/__init__.py": "",
        "backends/ssh/__init__.py": "",
        "backends/ssh/backend.py": "",
        "cli.py": "def main():\n    from substrax_tasks.backends.ssh.backend import SshBackend\n",
    }
    for name, source in sources.items():
        path = tmp_path / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    graph = graph_of(modules_of(tmp_path / ROOT))
    assert cycles(graph) == [["substrax_tasks.errors", "substrax_tasks.store.handle"]]
    assert graph["substrax_tasks.cli"] == {
        "substrax_tasks.backends", "substrax_tasks.backends.ssh", "substrax_tasks.backends.ssh.backend"
    }


# ---- the core reads no backend's state (store/handle.py: RunHandle.backend_state)

CORE_PACKAGES = ("step", "run", "store", "uptodate", "cache", "cli")
# The one core module that touches the backend's part: it carries it whole
# through each write of a handle.
CARRIER = f"{ROOT}.store.run_store"


def backend_state_uses(source: str) -> list[tuple[int, str]]:
    """Each `.backend_state` in `source`: its line and how it is used
    ("whole": passed or assigned as it is; "read": indexed, tested with
    `in`, or a method of it called)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "backend_state":
            parent = parents.get(node)
            read = (
                (isinstance(parent, ast.Subscript) and parent.value is node)
                or isinstance(parent, ast.Attribute)  # .get, .items, ...
                or (isinstance(parent, ast.Compare) and node in parent.comparators)
            )
            uses.append((node.lineno, "read" if read else "whole"))
    return sorted(uses)


def test_the_core_never_reads_a_backends_state() -> None:
    """A backend's keys are its own (Backend.State); the core asks the
    backend (ran_on, released, lifetime_left, capabilities) instead."""
    core = {m: p for m, p in MODULES.items() if m.split(".")[1:2] and m.split(".")[1] in CORE_PACKAGES}
    assert f"{ROOT}.cli.main" in core and CARRIER in core  # the walk sees the core
    found = sorted(
        f"{module}:{line} {how}"
        for module, path in core.items()
        for line, how in backend_state_uses(path.read_text(encoding="utf-8"))
        if how == "read" or module != CARRIER
    )
    assert found == []


def test_a_read_of_the_backends_state_is_found() -> None:
    source = (
        "a = handle.backend_state['cluster']\n"
        "b = handle.backend_state.get('job_id')\n"
        "c = 'job_id' in handle.backend_state\n"
        "d = dict(handle.backend_state)\n"
    )
    assert backend_state_uses(source) == [(1, "read"), (2, "read"), (3, "read"), (4, "whole")]
