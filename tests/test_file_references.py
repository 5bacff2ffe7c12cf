"""Every file that the docs, the README and the code's docstrings and comments name exists.

A reader follows such a name to find the code or the doc it points at; a name left behind
by a move or a rename sends them nowhere. A name is a path-like word ending in one of the
repository's own file extensions (`store/claims.py`, `docs/worker.md`, `README.md`). It
exists when some file of the repository ends with that path: `kinds/diloco/rounds.py`
is `src/idlegrid/kinds/diloco/rounds.py`, and a bare `grid.py` names whichever `grid.py`
the text is about. Names of files that are not the repository's (a volunteer's settings
file, one a test or a build writes) are listed in `NOT_IN_THE_REPOSITORY` with why.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EXTENSIONS = ("py", "md", "sh", "toml", "cfg", "ini", "html", "js", "css", "ps1", "txt")
# A path-like word: letters, digits, `_ . - /`, ending in a known extension, not part of a
# URL or a glob.
NAME = re.compile(
    r"(?<![\w./:*{<$~-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:" + "|".join(EXTENSIONS) + r"))(?![\w/*(-])"
)

# Files a text names that the repository does not hold, by design.
NOT_IN_THE_REPOSITORY = {
    "notes.txt",  # a researcher's own text, in the examples of training a model
    "alembic.ini",  # named as what the migrations do without
    "convert_hf_to_gguf.py",  # llama.cpp's converter, named where the export matches it
}


def repository_files() -> list[str]:
    """Every file under the repository, as paths relative to its root."""
    skip = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
    found = []
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if skip.intersection(relative.parts) or not path.is_file():
            continue
        found.append(relative.as_posix())
    return found


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_files() -> list[Path]:
    skip = {".venv", "__pycache__", "migrations"}
    return [
        p
        for folder in ("src", "tests", "benchmarks", "scripts")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if not skip.intersection(p.relative_to(ROOT).parts)
    ]


def prose_of_python(path: Path) -> Iterator[tuple[int, str]]:
    """The docstrings and comments of a module, each with its first line."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ) and (docstring := ast.get_docstring(node, clean=False)):
            first = node.body[0]
            yield first.lineno, docstring
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def prose_of_doc(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text().splitlines(), start=1)


def _in_url(text: str, start: int) -> bool:
    before = text[:start].rsplit(None, 1)[-1] if text[:start].strip() else ""
    return "://" in before or before.endswith(("www.", "github.com/"))


def exists(name: str, files: list[str]) -> bool:
    if name in NOT_IN_THE_REPOSITORY:
        return True
    return any(f == name or f.endswith("/" + name) for f in files)


def stale_references() -> list[str]:
    """`file:line names missing` for every name of a file that the repository lacks."""
    files = repository_files()
    texts = [(p, prose_of_doc(p)) for p in _docs()]
    texts += [(p, prose_of_python(p)) for p in _python_files()]
    stale = []
    for path, prose in texts:
        for line, text in prose:
            for match in NAME.finditer(text):
                if _in_url(text, match.start()):
                    continue
                name = match.group(1)
                while name.startswith(("./", "../")):
                    name = name.split("/", 1)[1]
                if not exists(name, files):
                    where = path.relative_to(ROOT).as_posix()
                    stale.append(f"{where}:{line} names {name}")
    return sorted(set(stale))


def test_every_named_file_exists() -> None:
    assert stale_references() == []


def test_the_check_finds_a_missing_file_and_passes_a_present_one() -> None:
    files = ["src/idlegrid/store/claims.py", "docs/worker.md", "README.md"]
    assert exists("store/claims.py", files)
    assert exists("claims.py", files)
    assert exists("docs/worker.md", files)
    assert not exists("store/claim.py", files)
    assert not exists("laims.py", files)  # a suffix of a name is not the name
    assert not exists("DESIGN.md", files)
    text = "see `store/claims.py` and https://example.org/a/b.py, not docs/gone.md"
    assert [m.group(1) for m in NAME.finditer(text) if not _in_url(text, m.start())] == [
        "store/claims.py",
        "docs/gone.md",
    ]


if __name__ == "__main__":
    for reference in stale_references():
        print(reference)
