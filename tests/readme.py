"""The README's text as tests run it: a section by its heading, its code blocks, and the
command lines of a block (comments left out)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    """The README's text from the heading that starts with `title` to the next heading."""
    text = README.read_text()
    start = text.index(f"## {title}")
    found = re.search(r"\n#{2,} ", text[start + 1 :])
    return text[start : start + 1 + found.start()] if found else text[start:]


def blocks(text: str, language: str) -> list[str]:
    """The code blocks of `text` in `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def commands(block: str) -> list[str]:
    """The block's command lines, comments and `pip install` (done here already) left out."""
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "pip install"))]
