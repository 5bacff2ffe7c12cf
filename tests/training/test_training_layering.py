"""Import rules of DiLoCo's code: pure policy needs no torch, nothing needs the server.

The numpy library lives in `idlegrid.training`; the kind's own pure modules (payload
bytes, data, corpus, worker caches) in `idlegrid.kinds.diloco`, beside its torch code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import run_python

SOURCE = Path(__file__).resolve().parents[2] / "src"
TRAINING = SOURCE / "idlegrid" / "training"
DILOCO = SOURCE / "idlegrid" / "kinds" / "diloco"
# Policy: plain values in, decisions out; the coordinator runs these (through the kind).
PURE = ("idlegrid.training.aggregate", "idlegrid.training.compression", "idlegrid.training.flat",
        "idlegrid.training.outer", "idlegrid.training.closing", "idlegrid.kinds.diloco.tasks",
        "idlegrid.training.verify", "idlegrid.kinds.diloco.data",
        "idlegrid.kinds.diloco.char_corpus", "idlegrid.kinds.diloco.worker_state",
        "idlegrid.training.schedule")  # fmt: skip
# The kind's worker side: its torch code.
TORCH_SIDE = ("idlegrid.kinds.diloco.inner", "idlegrid.training.torch_modules",
              "idlegrid.kinds.diloco.run")  # fmt: skip
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
            # `from package import module` names the module.
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(sub if _path(sub).exists() else node.module for sub in subs)
    return found


def _banned(names: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_torch_and_no_server(module: str) -> None:
    names = _imports(_path(module), top_level_only=False)
    # Of the kinds, a pure module may import only the kind's other pure modules.
    names = {name for name in names if name not in PURE}
    assert _banned(names, ("torch", *TORCH_SIDE, "idlegrid.kinds", *SERVER)) == []


def _path(module: str) -> Path:
    return SOURCE.joinpath(*module.split(".")).with_suffix(".py")


def test_the_library_imports_no_kind() -> None:
    """`idlegrid.training` is the math DiLoCo's kind uses, not the other way round."""
    offenders = {
        path.stem: _banned(_imports(path, top_level_only=False), ("idlegrid.kinds",))
        for path in TRAINING.glob("*.py")
    }
    assert {stem: names for stem, names in offenders.items() if names} == {}


@pytest.mark.parametrize(
    "path", sorted([*TRAINING.glob("*.py"), *DILOCO.glob("*.py")]), ids=lambda p: p.stem
)
def test_only_torch_modules_imports_torch_at_module_level(path: Path) -> None:
    names = _imports(path, top_level_only=True)
    allowed = ("torch",) if path.stem == "torch_modules" else ()
    assert _banned(names, tuple(b for b in ("torch", *SERVER) if b not in allowed)) == []


def test_the_coordinators_training_modules_load_without_torch() -> None:
    modules = ", ".join(
        (*PURE, "idlegrid.training.models", "idlegrid.kinds.diloco.kind")
    )  # fmt: skip
    code = f"import sys, {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    run_python(code, timeout_s=60)
