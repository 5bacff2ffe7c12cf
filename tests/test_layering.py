"""DESIGN.md's import rules, checked on the source: which part may import which."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "idlegrid"


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files(part: str) -> list[Path]:
    target = PACKAGE / part
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


FORBIDDEN = [
    ("protocol.py", ("idlegrid",)),
    ("kinds", ("idlegrid.coordinator", "idlegrid.worker", "idlegrid.store")),
    (
        "policy",
        (
            "idlegrid.store",
            "idlegrid.broker",
            "idlegrid.coordinator",
            "fastapi",
            "sqlalchemy",
            "websockets",
            "torch",
        ),
    ),
    ("worker", ("idlegrid.coordinator", "idlegrid.store", "idlegrid.broker")),
    ("coordinator", ("idlegrid.worker", "torch", "sentence_transformers")),
    ("store", ("fastapi", "starlette", "idlegrid.coordinator")),
    ("broker", ("fastapi", "starlette", "idlegrid.coordinator")),
]


@pytest.mark.parametrize(("part", "banned"), FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_part_does_not_import(part: str, banned: tuple[str, ...]) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _files(part)
        for name in _imports(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]
    assert offenders == []


def test_kinds_import_ml_libraries_only_inside_functions() -> None:
    heavy = ("torch", "sentence_transformers", "transformers", "onnxruntime")
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name} at module level"
        for path in _files("kinds")
        for name in _imports(path, top_level_only=True)
        if any(name == h or name.startswith(h + ".") for h in heavy)
    ]
    assert offenders == []


def test_coordinator_runs_without_torch() -> None:
    code = (
        "import sys; import idlegrid.coordinator.app, idlegrid.client, idlegrid.cli; "
        "assert 'torch' not in sys.modules and 'sentence_transformers' not in sys.modules; "
        "assert 'onnxruntime' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
