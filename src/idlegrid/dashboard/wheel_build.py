"""The wheel /download serves, built by the coordinator itself when its download
directory lacks this version's (its first start, or the first after an upgrade).

It can from a source checkout (`pip install -e .`, scripts/bootstrap.sh): `pip wheel
--no-deps` of the checkout's `pyproject.toml` and `src/`, copied to a temporary directory
first, so the checkout gets no `build/` and two coordinators building at once never meet;
a few seconds of CPU. Installed from a wheel (`pip install idlegrid-*.whl`), it packs its
installed files again as the wheel they came from (`repack`). The one-file worker takes
minutes and PyInstaller: `scripts/build-downloads.sh` builds it. What the builder did,
or why it could not, is for the operator (it names paths); visitors are only told
whether a package is coming.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import hashlib
import importlib.metadata
import importlib.util
import logging
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import idlegrid
from idlegrid import __version__

log = logging.getLogger(__name__)
WHEEL = f"idlegrid-{__version__}-py3-none-any.whl"
BUILD_TIMEOUT_S = 600.0
# What setuptools reads besides src/: the project's metadata, its readme and licences.
_PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE", "LICENSE.txt", "NOTICE", "MANIFEST.in")
# What pip adds to an installed package's dist-info that its wheel did not hold (RECORD
# is written anew).
_INSTALL_ONLY = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")


class BuildState(enum.StrEnum):
    OFF = "off"  # not asked to build (embedded apps, tests): the operator builds
    PRESENT = "present"  # the wheel was there already
    BUILDING = "building"
    BUILT = "built"
    FAILED = "failed"  # the reason says why (for the operator)
    UNAVAILABLE = "unavailable"  # this install cannot build it; the reason says what can


def source_checkout() -> Path | None:
    """The source checkout this idlegrid runs from (an editable install), if it does."""
    root = Path(idlegrid.__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if not (root / "src" / "idlegrid" / "__init__.py").is_file() or not pyproject.is_file():
        return None
    return root if 'name = "idlegrid"' in pyproject.read_text(encoding="utf-8") else None


def installed_files() -> list[tuple[Path, str]] | None:
    """(file, its name in a wheel) of an idlegrid installed from a wheel, as its RECORD
    lists them; None for an editable install (its files are a source checkout's) or
    one whose RECORD is missing or names a file that is gone."""
    try:
        dist = importlib.metadata.distribution("idlegrid")
    except importlib.metadata.PackageNotFoundError:
        return None
    if "editable" in (dist.read_text("direct_url.json") or "") or not dist.files:
        return None
    found = []
    for record in dist.files:
        name = str(record)
        if name.startswith("..") or "__pycache__" in name or name.endswith(".pyc"):
            continue  # scripts pip wrote into bin/, and bytecode: not the wheel's
        if name.split("/")[-1] in _INSTALL_ONLY and ".dist-info/" in name:
            continue
        path = Path(str(dist.locate_file(record)))
        if not path.is_file():
            return None
        found.append((path, name))
    return found if any(name == "idlegrid/__init__.py" for _, name in found) else None


def unbuildable_reason(root: Path | None) -> str | None:
    """Why this install cannot build its wheel, with what the operator can do; None: it can."""
    how = "put the wheel there with scripts/build-downloads.sh from a checkout of this version"
    if root is None:
        if installed_files() is not None:
            return None
        return f"this coordinator is neither a source checkout nor installed from a wheel: {how}"
    if importlib.util.find_spec("setuptools") is None:
        return f"setuptools is not installed here (pip install setuptools), or {how}"
    return None


def repack(files: list[tuple[Path, str]], wheel: Path) -> None:
    """Write an installed idlegrid's files as a wheel again, with a RECORD of their
    hashes (PEP 376/427): what pip installs from it is what this coordinator runs."""
    rows = []
    record = next(name for _, name in files if name.endswith(".dist-info/METADATA"))
    record = record.rsplit("/", 1)[0] + "/RECORD"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in sorted(files, key=lambda item: (".dist-info/" in item[1], item[1])):
            data = path.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            archive.writestr(name, data)
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
        archive.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")


class WheelBuilder:
    """Builds the wheel once, in the background, when it is missing; an owned task of the
    app's lifespan (`start`, `stop`). Its state is what /download tells."""

    def __init__(self, directory: Path, *, enabled: bool) -> None:
        self.directory = directory
        self.enabled = enabled
        self.state = BuildState.OFF
        self.reason = ""
        self._task: asyncio.Task[None] | None = None

    @property
    def wheel(self) -> Path:
        return self.directory / WHEEL

    async def start(self) -> None:
        if not self.enabled:
            return
        if self.wheel.is_file():
            self.state = BuildState.PRESENT
            return
        root = source_checkout()
        reason = unbuildable_reason(root)
        if reason is not None:
            self.state, self.reason = BuildState.UNAVAILABLE, reason
            log.warning("/download serves no worker wheel: %s", self.reason)
            return
        self.state = BuildState.BUILDING
        self._task = asyncio.create_task(self._build(root), name="wheel-build")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait(self) -> BuildState:
        """The state once a build in progress ended (tests, and `idlegrid serve` logs)."""
        if self._task is not None:
            await asyncio.shield(self._task)
        return self.state

    async def _build(self, root: Path | None) -> None:
        source = root or "the installed package"
        log.info("building the worker wheel that /download serves, from %s", source)
        try:
            with tempfile.TemporaryDirectory(prefix="idlegrid-wheel-") as scratch:
                if root is not None:
                    built = await _pip_wheel(root, Path(scratch))
                else:
                    built, files = Path(scratch) / WHEEL, installed_files()
                    if files is None:
                        raise BuildError("the installed package's files changed meanwhile")
                    await asyncio.to_thread(repack, files, built)
                self.directory.mkdir(parents=True, exist_ok=True)
                # Copied under a hidden name and renamed: /download never serves half a file.
                partial = self.directory / f".{WHEEL}.part"
                await asyncio.to_thread(shutil.copyfile, built, partial)
                partial.replace(self.wheel)
        except (OSError, BuildError) as exc:
            self.state, self.reason = BuildState.FAILED, str(exc)
            log.warning("the worker wheel was not built: %s", exc)
            return
        self.state = BuildState.BUILT
        log.info("built %s for /download", self.wheel)


class BuildError(RuntimeError):
    """pip could not build the wheel; the message has the end of its output."""


async def _pip_wheel(root: Path, scratch: Path) -> Path:
    tree, out = scratch / "tree", scratch / "wheel"
    await asyncio.to_thread(_copy_project, root, tree)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--disable-pip-version-check", "-w", str(out), str(tree),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), BUILD_TIMEOUT_S)
    except (asyncio.CancelledError, TimeoutError):
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        tail = output.decode(errors="replace").strip()[-800:]
        raise BuildError(f"pip wheel of {root} ended with {process.returncode}: {tail}")
    built = out / WHEEL
    if not built.is_file():
        raise BuildError(f"pip wheel of {root} made no {WHEEL} (is the checkout this version?)")
    return built


def _copy_project(root: Path, tree: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(root / "src", tree / "src", ignore=skip)
    for name in _PROJECT_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, tree / name)
