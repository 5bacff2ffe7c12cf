"""A deterministic corpus of real English text that ships with every Python: stdlib docstrings.

Demos and benchmarks need a few thousand natural paragraphs without a download. The
docstrings of the standard library are prose written by people, vary in length like real
documents, and are the same on every machine with the same Python version.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
from collections.abc import Iterator
from types import ModuleType

# Pure-Python modules that import in milliseconds, print nothing, start no threads and emit
# no DeprecationWarning on 3.11 (so `filterwarnings = error` stays quiet). `typing` is left
# out: touching its deprecated `typing.io` namespace warns.
_MODULES = (
    "abc", "argparse", "ast", "base64", "calendar", "cmd", "codecs", "collections",
    "configparser", "contextlib", "copy", "dataclasses", "difflib", "doctest",
    "email.message", "enum", "fractions", "ftplib", "functools", "gzip", "http.client",
    "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress", "json", "logging",
    "logging.handlers", "mailbox", "numbers", "optparse", "pathlib", "pickletools",
    "platform", "queue", "random", "shutil", "smtplib", "socketserver", "statistics",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "traceback",
    "unittest.case", "urllib.parse", "zipfile",
)  # fmt: skip

MIN_CHARS = 40
MAX_CHARS = 1000
_BLANK_LINE = re.compile(r"\n\s*\n")
_LETTER = re.compile(r"[A-Za-z]")


def stdlib_paragraphs(limit: int = 2000) -> list[str]:
    """The first `limit` distinct docstring paragraphs of a fixed set of stdlib modules.

    Paragraphs are split on blank lines, whitespace is collapsed, and only paragraphs of
    40..1000 characters that contain letters and are not doctest examples are kept. The
    order is fixed: modules sorted by name, then the module's own docstring, then its
    classes (with their methods) and functions sorted by name. About 3,500 paragraphs
    exist on Python 3.11.
    """
    if limit < 0:
        raise ValueError("limit must be >= 0")
    return list(itertools.islice(_unique_paragraphs(), limit))


def _unique_paragraphs() -> Iterator[str]:
    seen: set[str] = set()
    for module_name in sorted(_MODULES):
        for docstring in _docstrings(importlib.import_module(module_name)):
            for paragraph in _paragraphs(docstring):
                if paragraph not in seen:
                    seen.add(paragraph)
                    yield paragraph


def _docstrings(module: ModuleType) -> Iterator[str]:
    """Own docstrings of a module, its classes, their methods and its functions."""
    yield from _doc_of(module)
    for _name, member in sorted(vars(module).items()):
        # Re-exported names would repeat another module's text under this module's turn.
        if getattr(member, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(member):
            yield from _doc_of(member)
            for _method_name, attribute in sorted(vars(member).items()):
                yield from _doc_of(_underlying_function(attribute))
        elif inspect.isfunction(member):
            yield from _doc_of(member)


def _underlying_function(attribute: object) -> object:
    if isinstance(attribute, staticmethod | classmethod):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute


def _doc_of(obj: object) -> Iterator[str]:
    # `__doc__` rather than inspect.getdoc: getdoc inherits a base class's docstring,
    # which would credit the same text to many members.
    if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
        doc = obj.__doc__
        if isinstance(doc, str):
            yield doc


def _paragraphs(docstring: str) -> Iterator[str]:
    for block in _BLANK_LINE.split(inspect.cleandoc(docstring)):
        paragraph = " ".join(block.split())
        if _is_prose(paragraph):
            yield paragraph


def _is_prose(paragraph: str) -> bool:
    return (
        MIN_CHARS <= len(paragraph) <= MAX_CHARS
        and _LETTER.search(paragraph) is not None
        # Interactive examples are code, not text; they would skew an embedding corpus.
        and not paragraph.startswith(">>>")
    )
