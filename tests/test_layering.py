"""The import rules of docs/architecture.md, checked on the source: which part may import which.

Imports are read from the syntax tree, all of them: absolute and relative ones, those
under `if TYPE_CHECKING:` (a type-only import is still a dependency of the design, and
the usual way a cycle hides), and those inside functions. Lazy imports count too: a
function-level import keeps heavy libraries (torch) off the coordinator's start-up
path, which is fine, but a cycle it closes is a cycle all the same (one part that calls
back into its caller), so the cycle check makes no exception for them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SOURCE / "idlegrid"


@dataclass(frozen=True)
class Imported:
    name: str  # the module imported (a submodule where `from package import submodule`)
    line: int
    lazy: bool  # inside a function body
    type_only: bool = False  # under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`) by dotted name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imports_of(module: str, path: Path, known: Mapping[str, Path]) -> list[Imported]:
    """What `module` imports, relative imports resolved against its package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Imported] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            typing = type_only or (
                isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body
            )
            if isinstance(child, ast.Import):
                found.extend(Imported(a.name, child.lineno, inner, typing) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _from_base(child, package)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    name = sub if sub in known else base
                    found.append(Imported(name, child.lineno, inner, typing))
            visit(child, inner, typing)

    visit(ast.parse(path.read_text(), filename=str(path)), False, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _from_base(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"relative import beyond the top-level package in {package}")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_graph(known: Mapping[str, Path]) -> dict[str, dict[str, Imported]]:
    """module -> {module of the same package it imports: where}."""
    graph: dict[str, dict[str, Imported]] = {module: {} for module in known}
    for module, path in known.items():
        for imported in imports_of(module, path, known):
            if imported.name in known and imported.name != module:
                graph[module].setdefault(imported.name, imported)
    return graph


def cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(graph[target])))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return sorted(found)


def describe(component: list[str], graph: Mapping[str, Mapping[str, Imported]]) -> str:
    """One loop through a cycle's modules, each step with the line that imports."""
    members = set(component)
    start = component[0]
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first, inside the component, back to the start
        node = frontier.pop(0)
        for target in graph[node]:
            if target == start:
                loop = [*paths[node], start]
                return (
                    " -> ".join(
                        f"{a} (line {graph[a][b].line}{', lazy' if graph[a][b].lazy else ''})"
                        for a, b in zip(loop, loop[1:], strict=False)
                    )
                    + f" -> {start}"
                )
            if target in members and target not in paths:
                paths[target] = [*paths[node], target]
                frontier.append(target)
    return ", ".join(component)


KNOWN = modules_under(SOURCE, "idlegrid")
GRAPH = import_graph(KNOWN)


def _files(part: str) -> list[tuple[str, Path]]:
    prefix = "idlegrid." + part.removesuffix(".py").replace("/", ".")
    return [(m, p) for m, p in KNOWN.items() if m == prefix or m.startswith(prefix + ".")]


HTTP_CLIENTS = ("httpx", "requests", "aiohttp", "urllib3", "urllib.request", "http.client")
# Pure rules: plain values in, decisions out; no database, transport, network or model.
IMPURE = (
    "idlegrid.store",
    "idlegrid.broker",
    "idlegrid.coordinator",
    "fastapi",
    "starlette",
    "sqlalchemy",
    "asyncpg",
    "websockets",
    "socket",
    "redis",
    *HTTP_CLIENTS,
    "torch",
)
FORBIDDEN = [
    ("protocol.py", ("idlegrid",)),
    ("kinds", ("idlegrid.coordinator", "idlegrid.worker", "idlegrid.store")),
    # Peer-to-peer averaging: used by a kind (worker side) and the coordinator (its
    # bootstrap peer); it knows neither, nor any kind.
    ("p2p", ("idlegrid.coordinator", "idlegrid.worker", "idlegrid.store", "idlegrid.kinds")),
    ("policy", IMPURE),
    ("verification", IMPURE),
    ("worker", ("idlegrid.coordinator", "idlegrid.store", "idlegrid.broker")),
    (
        "coordinator",
        (
            "idlegrid.worker",
            "idlegrid.dashboard",
            "idlegrid.app",
            "torch",
            "sentence_transformers",
            "sqlalchemy",
            "asyncpg",
        ),
    ),
    ("dashboard", ("idlegrid.app", "sqlalchemy", "asyncpg")),
    ("store", ("fastapi", "starlette", "idlegrid.coordinator")),
    ("broker", ("fastapi", "starlette", "idlegrid.coordinator")),
]


def _banned(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize(("part", "banned"), FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_part_does_not_import(part: str, banned: tuple[str, ...]) -> None:
    offenders = [
        f"{module} imports {imported.name} (line {imported.line})"
        for module, path in _files(part)
        for imported in imports_of(module, path, KNOWN)
        if _banned(imported.name, banned)
    ]
    assert offenders == []


def test_no_import_cycle_between_modules() -> None:
    found = [describe(component, GRAPH) for component in cycles(GRAPH)]
    assert found == [], "import cycles:\n" + "\n".join(found)


# Who is trusted and who is paid: the trust steps and the price of work. The store
# writes what verification's ledger decides; no other part applies these rules itself.
VERIFICATION_RULES = (
    "after_valid",
    "after_unchecked",
    "after_invalid",
    "after_error",
    "after_error_withdrawn",
    "after_suspected",
    "after_cleared",
    "after_upheld",
    "credit_for",
)


def _names_used(path: Path) -> list[tuple[str, int]]:
    """Every name a module refers to, bare or as an attribute, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Name):
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.Attribute):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.alias):
            found.append((node.name.rpartition(".")[2], node.lineno))
    return found


def test_only_verification_decides_trust_and_credit() -> None:
    offenders = [
        f"{module} uses {name} (line {line})"
        for module, path in KNOWN.items()
        if not (module == "idlegrid.verification" or module.startswith("idlegrid.verification."))
        for name, line in _names_used(path)
        if name in VERIFICATION_RULES
    ]
    assert offenders == []


def test_kinds_import_ml_libraries_only_inside_functions() -> None:
    heavy = ("torch", "sentence_transformers", "transformers", "onnxruntime", "hivemind")
    offenders = [
        f"{module} imports {imported.name} at module level (line {imported.line})"
        for module, path in [*_files("kinds"), *_files("p2p")]
        for imported in imports_of(module, path, KNOWN)
        if not (imported.lazy or imported.type_only) and _banned(imported.name, heavy)
    ]
    assert offenders == []


def test_coordinator_runs_without_torch() -> None:
    code = (
        "import sys; import idlegrid.app, idlegrid.client, idlegrid.cli.main; "
        "assert 'torch' not in sys.modules and 'sentence_transformers' not in sys.modules; "
        "assert 'onnxruntime' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# The coordinator's modules that the dashboard may use: the grid's facade and what the API
# shows. Everything else of the coordinator is its own business.
COORDINATOR_SURFACE = (
    "idlegrid.coordinator.grid",
    "idlegrid.coordinator.api.views",
    "idlegrid.coordinator.auth",
    "idlegrid.coordinator.quota_checks",
    "idlegrid.coordinator.metrics",
)
# Entry points above the application: they may import anything.
ENTRY_POINTS = ("idlegrid.app", "idlegrid.cli", "idlegrid.devtools")


def test_the_dashboard_uses_only_the_coordinators_public_surface() -> None:
    offenders = [
        f"{module} imports {imported.name} (line {imported.line})"
        for module, path in _files("dashboard")
        for imported in imports_of(module, path, KNOWN)
        if _banned(imported.name, ("idlegrid.coordinator",))
        and imported.name not in COORDINATOR_SURFACE
    ]
    assert offenders == []


def test_only_the_composition_root_imports_both_coordinator_and_dashboard() -> None:
    both = []
    for module, path in KNOWN.items():
        if _banned(module, (*ENTRY_POINTS, "idlegrid.coordinator", "idlegrid.dashboard")):
            continue  # the two packages themselves are held by the rules above
        names = [imported.name for imported in imports_of(module, path, KNOWN)]
        if any(_banned(n, ("idlegrid.coordinator",)) for n in names) and any(
            _banned(n, ("idlegrid.dashboard",)) for n in names
        ):
            both.append(module)
    assert both == []
    assert "idlegrid.app" in KNOWN  # the root itself: create_app, above both


# Kinds are plug-ins: outside kinds/, code reaches a kind through the registry
# (`idlegrid.kinds.get_kind`) and the interface (`idlegrid.kinds.base`), never a concrete
# kind's module, so that no part outside kinds/ depends on one kind (an isinstance of a
# concrete kind needs its import). The exceptions: helpers of one kind's input format or
# examples, used where that kind is the point, never a kind class.
KIND_INTERFACE = ("idlegrid.kinds", "idlegrid.kinds.base")
KIND_EXCEPTIONS = {
    # The researcher's side zips a folder of images as onnx-infer's `data` input: the
    # input format is that kind's, and `Client.submit_images` and `idlegrid submit` name it.
    ("idlegrid.client", "idlegrid.kinds.onnx.data"),
    ("idlegrid.cli.researcher", "idlegrid.kinds.onnx.data"),
    # The demo runs each kind on sample data and checks its result against a reference
    # computed on the spot: kind by kind, as a development aid (not shipped to workers).
    ("idlegrid.devtools.demo", "idlegrid.kinds.embed_text.samples"),
    ("idlegrid.devtools.demo", "idlegrid.kinds.embed_text.kind"),
    ("idlegrid.devtools.demo", "idlegrid.kinds.onnx.examples"),
    ("idlegrid.devtools.demo", "idlegrid.kinds.onnx.data"),
    ("idlegrid.devtools.demo", "idlegrid.kinds.onnx.compare"),
    ("idlegrid.devtools.llm_demo", "idlegrid.kinds.llm_generate.samples"),
    # The hello reports the node's llama.cpp backend and device, read by the helpers the
    # llm-generate runtime records in each output.
    ("idlegrid.worker.hardware", "idlegrid.kinds.llm_generate.runtime"),
}


def _outside_kinds() -> list[tuple[str, Path]]:
    return [(m, p) for m, p in KNOWN.items() if not _banned(m, ("idlegrid.kinds",))]


def test_no_concrete_kind_is_imported_outside_kinds() -> None:
    offenders = sorted(
        f"{module} imports {imported.name} (line {imported.line})"
        for module, path in _outside_kinds()
        for imported in imports_of(module, path, KNOWN)
        if _banned(imported.name, ("idlegrid.kinds",))
        and imported.name not in KIND_INTERFACE
        and (module, imported.name) not in KIND_EXCEPTIONS
    )
    assert offenders == []


def test_the_kind_exceptions_import_no_kind_class() -> None:
    """Where a kind's module is imported outside kinds/, only helpers are: no TaskKind."""
    import importlib

    from idlegrid.kinds.base import TaskKind

    classes = []
    for module, path in _outside_kinds():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not _banned(node.module, ("idlegrid.kinds",)):
                    continue
                source = importlib.import_module(node.module)
                for alias in node.names:
                    found = getattr(source, alias.name, None)
                    concrete = isinstance(found, type) and issubclass(found, TaskKind)
                    if concrete and found is not TaskKind:
                        classes.append(f"{module} imports {node.module}.{alias.name}")
    assert classes == []


def test_every_kind_exception_is_still_needed() -> None:
    used = {
        (module, imported.name)
        for module, path in _outside_kinds()
        for imported in imports_of(module, path, KNOWN)
    }
    assert KIND_EXCEPTIONS - used == set()


# -- the checker itself, on a package written for the purpose --------------------------


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules_under(root, "pkg")


def test_the_checker_finds_a_cycle_through_relative_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    known = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from .sub.c import Thing\n"
            ),
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from ..a import x\n",
            "d.py": "import pkg.a\n",  # into the cycle, not part of it
        },
    )
    graph = import_graph(known)
    assert graph["pkg.b"]["pkg.sub.c"].type_only and graph["pkg.sub.c"]["pkg.a"].lazy
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert describe(["pkg.a", "pkg.b", "pkg.sub.c"], graph) == (
        "pkg.a (line 1) -> pkg.b (line 3) -> pkg.sub.c (line 2, lazy) -> pkg.a"
    )


def test_the_checker_sees_no_cycle_in_a_layered_package(tmp_path: Path) -> None:
    known = _package(
        tmp_path,
        {
            "__init__.py": "from .top import run\n",
            "top.py": "from .mid import helper\nfrom pkg import low\n",
            "mid.py": "from . import low\n",
            "low.py": "import os\n",
        },
    )
    graph = import_graph(known)
    assert graph["pkg.top"].keys() == {"pkg.mid", "pkg.low"}
    assert cycles(graph) == []
