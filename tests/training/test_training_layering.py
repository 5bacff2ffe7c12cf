"""Import rules of the training package: pure policy needs no torch, nothing needs the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import run_python

TRAINING = Path(__file__).resolve().parents[2] / "src" / "idlegrid" / "training"
# Policy: plain values in, decisions out; the coordinator runs these.
PURE = ("aggregate", "compression", "flat", "outer", "closing", "tasks", "verify", "data",
        "corpus", "worker_state", "schedule")  # fmt: skip
SERVER = ("idlegrid.coordinator", "idlegrid.store", "idlegrid.broker", "idlegrid.worker",
          "fastapi", "starlette", "sqlalchemy", "websockets")  # fmt: skip


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _banned(names: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_torch_and_no_server(module: str) -> None:
    names = _imports(TRAINING / f"{module}.py", top_level_only=False)
    assert _banned(names, ("torch", "idlegrid.training.inner", "idlegrid.training.torch_modules",
                           "idlegrid.kinds", *SERVER)) == []  # fmt: skip


@pytest.mark.parametrize("path", sorted(TRAINING.glob("*.py")), ids=lambda p: p.stem)
def test_only_torch_modules_imports_torch_at_module_level(path: Path) -> None:
    names = _imports(path, top_level_only=True)
    allowed = ("torch",) if path.stem == "torch_modules" else ()
    assert _banned(names, tuple(b for b in ("torch", *SERVER) if b not in allowed)) == []


def test_the_coordinators_training_modules_load_without_torch() -> None:
    modules = ", ".join(f"idlegrid.training.{m}" for m in (*PURE, "models", "simulate"))
    code = f"import sys, {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    run_python(code, timeout_s=60)
