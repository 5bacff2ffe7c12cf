"""Sizes as people read them, for messages about limits."""

from __future__ import annotations

MIB = 1024 * 1024


def size_text(size: int) -> str:
    """A size as a person reads it: bytes under a KiB, else KiB, MiB or GiB."""
    if size < 1024:
        return f"{size} bytes"
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:,.1f}".removesuffix(".0") + f" {unit}"
    raise AssertionError("unreachable")
