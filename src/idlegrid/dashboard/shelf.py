"""The files a coordinator serves at /download, each hashed (SHA-256) once per version of
the file: this version's wheel and source, and the one-file workers."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from idlegrid import __version__
from idlegrid.dashboard.wheel_build import WheelBuilder

BINARY = re.compile(r"idlegrid-worker-(linux|macos|windows)-(x86_64|aarch64|arm64)(\.exe)?")


@dataclass(frozen=True)
class Package:
    """One file of the download directory."""

    name: str
    size: int
    sha256: str

    @property
    def is_wheel(self) -> bool:
        return self.name.endswith(".whl")

    @property
    def what(self) -> str:
        if self.is_wheel:
            return (
                f"Python wheel of idlegrid {__version__}: the worker (with the [worker] "
                "extra: every kind), the CLI and the SDK"
            )
        if self.name.endswith(".tar.gz"):
            return f"Source of idlegrid {__version__}"
        found = BINARY.fullmatch(self.name)
        system, machine = found.group(1, 2) if found else ("", "")
        return (
            f"One-file worker for {system.capitalize()} on {machine}, no Python needed "
            "(the kinds without an ML stack: sleep, noop)"
        )


def wanted(name: str) -> bool:
    """Whether a file of the download directory is served: this version's wheel and
    source, and the one-file workers; never a hidden or partial file."""
    ours = (f"idlegrid-{__version__}-py3-none-any.whl", f"idlegrid-{__version__}.tar.gz")
    return name in ours or BINARY.fullmatch(name) is not None


class Shelf:
    """The download directory's packages, each file hashed once per size and mtime."""

    def __init__(self, directory: Path, *, builder: WheelBuilder | None = None) -> None:
        self.directory = directory
        # What builds the wheel when it is missing (`idlegrid serve`), and how that went.
        self.builder = builder
        self._hashes: dict[tuple[str, int, int], str] = {}

    async def packages(self) -> list[Package]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.iterdir()):
            if not wanted(path.name) or not path.is_file():
                continue
            stat = path.stat()
            key = (path.name, stat.st_size, stat.st_mtime_ns)
            if key not in self._hashes:
                self._hashes[key] = await asyncio.to_thread(_sha256, path)
            found.append(Package(path.name, stat.st_size, self._hashes[key]))
        return found

    async def find(self, name: str) -> Package | None:
        return next((p for p in await self.packages() if p.name == name), None)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
