"""The worker's PyInstaller recipe for Linux, macOS and Windows, checked on any system:
its per-platform choices, the macOS Info.plist, the Windows version resource, and the
spec file run against stand-ins for PyInstaller's build steps."""

from __future__ import annotations

import ast
import importlib.util
import plistlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    path = ROOT / "packaging" / "build_worker.py"
    spec = importlib.util.spec_from_file_location("build_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_worker"] = module  # as the spec file imports it
    spec.loader.exec_module(module)
    return module


bw = _load()


@pytest.mark.parametrize(
    ("platform", "names", "consoles", "onefiles", "bundles"),
    [("linux", ["idlegrid-worker"], [True], [True], [None]),
     ("darwin", ["idlegrid-worker", "idlegrid-worker-tray"], [True, False], [True, False],
      [None, "idlegrid worker"]),
     ("win32", ["idlegrid-worker", "idlegrid-worker-tray"], [True, False], [True, True],
      [None, None])],
)  # fmt: skip
def test_each_system_builds_the_cli_and_its_tray_app(
    platform: str,
    names: list[str],
    consoles: list[bool],
    onefiles: list[bool],
    bundles: list[str | None],
) -> None:
    made = bw.programs(platform)
    assert [p.name for p in made] == names
    assert [p.console for p in made] == consoles
    assert [p.onefile for p in made] == onefiles
    assert [p.bundle for p in made] == bundles
    assert all((ROOT / "packaging" / p.entry).is_file() for p in made)


def test_install_looks_for_the_tray_programs_the_recipe_makes() -> None:
    """`idlegrid worker install` points the tray's login entry at these (worker/service.py)."""
    from idlegrid.worker import service

    darwin_tray, windows_tray = bw.programs("darwin")[1], bw.programs("win32")[1]
    assert f"{darwin_tray.bundle}.app" == service.TRAY_APP
    # PyInstaller's BUNDLE names the bundle's executable (Contents/MacOS) after its EXE.
    assert darwin_tray.name == windows_tray.name == service.TRAY_PROGRAM
    assert not windows_tray.console  # started with no console window


@pytest.mark.parametrize(
    ("platform", "wanted", "unwanted"),
    [("linux", {"Xlib.ext.screensaver", "pystray._gtk", "pystray._xorg"}, {"pystray._win32"}),
     ("darwin", {"pystray._darwin", "webview.platforms.cocoa"},
      {"pystray._gtk", "Xlib.ext.screensaver"}),
     ("win32", {"pystray._win32", "webview.platforms.winforms"},
      {"pystray._darwin", "pystray._xorg"})],
)  # fmt: skip
def test_hidden_imports_are_each_systems_backends(
    platform: str, wanted: set[str], unwanted: set[str]
) -> None:
    hidden = bw.hidden_imports(platform)
    assert "idlegrid.logs" in hidden and wanted <= set(hidden) and not unwanted & set(hidden)
    assert not set(hidden) & set(bw.excludes(platform, with_ml=False))


@pytest.mark.parametrize("platform", ["linux", "darwin", "win32"])
def test_excludes_leave_out_the_server_and_without_ml_the_ml_stack(platform: str) -> None:
    light, heavy = bw.excludes(platform, with_ml=False), bw.excludes(platform, with_ml=True)
    assert {"idlegrid.coordinator", "fastapi", "sqlalchemy"} <= set(light) & set(heavy)
    assert {"torch", "sentence_transformers"} <= set(light)
    assert not {"torch", "sentence_transformers"} & set(heavy)
    assert bw.collected_packages(with_ml=True) and not bw.collected_packages(with_ml=False)
    # The worker's own packages are never left out.
    assert not any(e.startswith(p) for e in light for p in bw.PACKAGES)


def test_linux_keeps_its_excludes_and_other_systems_drop_foreign_backends() -> None:
    assert bw.excludes("linux", with_ml=True) == list(bw.SERVER_SIDE)
    assert {"gi", "Xlib", "pystray._gtk"} <= set(bw.excludes("darwin", with_ml=True))
    assert {"gi", "webview.platforms.cocoa"} <= set(bw.excludes("win32", with_ml=True))


@pytest.mark.parametrize("platform", ["freebsd14", "cygwin", "emscripten"])
def test_an_unknown_system_is_refused_by_name(platform: str) -> None:
    with pytest.raises(bw.RecipeError, match=platform):
        bw.programs(platform)


def test_the_macos_tray_app_has_no_dock_icon_and_its_identity() -> None:
    keys = plistlib.loads(plistlib.dumps(bw.info_plist("0.1.0")))
    assert keys["LSUIElement"] is True  # a menu-bar-only app
    assert keys["CFBundleIdentifier"] == "org.idlegrid.worker-app"
    assert keys["CFBundleIdentifier"] not in {"org.idlegrid.worker", "org.idlegrid.tray"}
    assert keys["CFBundleShortVersionString"] == keys["CFBundleVersion"] == "0.1.0"
    assert keys["CFBundlePackageType"] == "APPL" and keys["LSMinimumSystemVersion"] == "11.0"


@pytest.mark.parametrize(
    ("version", "numbers"),
    [("0.1.0", (0, 1, 0, 0)), ("2", (2, 0, 0, 0)), ("1.2.3.4", (1, 2, 3, 4)),
     ("1.2.3rc1", (1, 2, 3, 0)), ("1.2.3+local", (1, 2, 3, 0))],
)  # fmt: skip
def test_version_numbers_for_windows(version: str, numbers: tuple) -> None:
    assert bw.version_tuple(version) == numbers


@pytest.mark.parametrize("version", ["", "v1.0", "1.70000.0"])
def test_a_version_windows_cannot_hold_is_refused(version: str) -> None:
    with pytest.raises(bw.RecipeError, match="version"):
        bw.version_tuple(version)


def _record(kind: str) -> Any:
    return lambda *args, **kwargs: {"kind": kind, "args": args, **kwargs}


@pytest.mark.parametrize("program", bw.programs("win32"))
def test_the_windows_version_resource_parses(program: Any) -> None:
    text = bw.windows_version_info("0.1.0", program)
    names = ["VSVersionInfo", "FixedFileInfo", "StringFileInfo", "StringTable",
             "StringStruct", "VarFileInfo", "VarStruct"]  # fmt: skip
    code = compile(ast.parse(text, mode="eval"), "version", "eval")
    tree = eval(code, {n: _record(n) for n in names})
    assert tree["ffi"]["filevers"] == tree["ffi"]["prodvers"] == (0, 1, 0, 0)
    (table,) = tree["kids"][0]["args"][0]
    strings = dict(s["args"] for s in table["args"][1])
    assert strings["OriginalFilename"] == f"{program.name}.exe"
    assert strings["ProductVersion"] == "0.1.0" and strings["ProductName"] == "idlegrid"


class _Analysis:
    """Stands in for PyInstaller's Analysis: keeps its options, has marked tables."""

    def __init__(self, scripts: list[str], **options: Any) -> None:
        self.entry, self.options = Path(scripts[0]).name, options
        self.pure: list[Any] = []
        self.scripts, self.binaries, self.datas = ["scripts"], ["bins"], ["datas"]


def _run_spec(platform: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> dict:
    """Run the spec file as PyInstaller does, with its build steps recorded, not built."""
    steps: dict[str, list] = {"Analysis": [], "EXE": [], "COLLECT": [], "BUNDLE": []}
    from PyInstaller.utils import hooks

    monkeypatch.setattr(hooks, "collect_submodules", lambda p: [f"{p}.all"])
    monkeypatch.setattr(hooks, "collect_data_files", lambda p: [(f"{p}/data", p)])
    monkeypatch.setattr(hooks, "collect_all", lambda p: ([], [(f"{p}.so", p)], [f"{p}.x"]))
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(sys, "argv", ["spec", *argv])

    def step(kind: str) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            factory = _Analysis if kind == "Analysis" else _record(kind)
            value = factory(*args, **kwargs)
            steps[kind].append(value)
            return value

        return made

    spec = ROOT / "packaging" / "idlegrid-worker.spec"
    namespace = {name: step(name) for name in steps} | {"PYZ": _record("PYZ")}
    namespace |= {"SPECPATH": str(spec.parent), "workpath": str(tmp_path), "__file__": str(spec)}
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec puts packaging/ first
    exec(compile(spec.read_text(), str(spec), "exec"), namespace)
    return steps


def test_the_spec_builds_linux_one_file_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = _run_spec("linux", monkeypatch, tmp_path)
    (analysis,) = steps["Analysis"]
    assert analysis.entry == "worker_entry.py"
    assert analysis.options["pathex"] == [str(ROOT / "src")]
    hidden = analysis.options["hiddenimports"]
    assert {"pystray._gtk", "Xlib.ext.screensaver", "idlegrid.logs"} <= set(hidden)
    assert {f"{p}.all" for p in bw.PACKAGES} <= set(hidden)
    assert "torch" in analysis.options["excludes"] and analysis.options["binaries"] == []
    (exe,) = steps["EXE"]
    assert exe["name"] == "idlegrid-worker" and exe["console"] is True and exe["version"] is None
    assert exe["args"][2:4] == (["bins"], ["datas"])  # one file: everything inside
    assert not steps["COLLECT"] and not steps["BUNDLE"] and not list(tmp_path.iterdir())


def test_the_spec_with_ml_bundles_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (analysis,) = _run_spec("linux", monkeypatch, tmp_path, "--with-ml")["Analysis"]
    assert "torch" not in analysis.options["excludes"]
    assert ("torch.so", "torch") in analysis.options["binaries"]
    assert "sentence_transformers.x" in analysis.options["hiddenimports"]


def test_the_spec_makes_the_macos_app_bundle(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = _run_spec("darwin", monkeypatch, tmp_path)
    assert [a.entry for a in steps["Analysis"]] == ["worker_entry.py", "tray_entry.py"]
    cli, tray = steps["EXE"]
    assert cli["name"] == "idlegrid-worker" and cli["console"] is True
    assert tray["console"] is False and tray["exclude_binaries"] is True
    (collected,) = steps["COLLECT"]
    assert collected["args"][0] is tray and collected["name"] == "idlegrid-worker-tray"
    (bundle,) = steps["BUNDLE"]
    assert bundle["args"][0] is collected and bundle["name"] == "idlegrid worker.app"
    assert bundle["bundle_identifier"] == "org.idlegrid.worker-app"
    assert bundle["info_plist"]["LSUIElement"] is True and bundle["version"] == bw.project_version()


def test_the_spec_gives_windows_programs_version_resources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = _run_spec("win32", monkeypatch, tmp_path)
    assert "pystray._win32" in steps["Analysis"][0].options["hiddenimports"]
    cli, tray = steps["EXE"]
    assert (cli["console"], tray["console"]) == (True, False)
    assert not steps["COLLECT"] and not steps["BUNDLE"]
    for exe in (cli, tray):
        text = Path(exe["version"]).read_text(encoding="utf-8")
        assert f"StringStruct('OriginalFilename', '{exe['name']}.exe')" in text


def test_the_build_command_line_passes_with_ml_to_the_spec(tmp_path: Path) -> None:
    arguments = bw.pyinstaller_arguments(with_ml=True, dist=tmp_path / "d", work=tmp_path / "w")
    assert arguments[0] == str(ROOT / "packaging" / "idlegrid-worker.spec")
    assert arguments[arguments.index("--distpath") + 1] == str(tmp_path / "d")
    assert arguments[arguments.index("--") :] == ["--", "--with-ml"]
    assert bw.pyinstaller_arguments(with_ml=False, dist=tmp_path, work=tmp_path)[-1] == "--"


def _tray_entry() -> ModuleType:
    path = ROOT / "packaging" / "tray_entry.py"
    spec = importlib.util.spec_from_file_location("tray_entry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "worker_arguments"),
    [([], ["tray"]), (["-psn_0_12345"], ["tray"]),
     (["--state-dir", "/s", "app"], ["--state-dir", "/s", "app"])],
)  # fmt: skip
def test_the_tray_app_is_the_tray_unless_told_otherwise(
    argv: list[str], worker_arguments: list[str]
) -> None:
    assert _tray_entry().arguments(argv) == worker_arguments


def test_the_windowless_program_logs_to_its_state_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    entry, log = _tray_entry(), tmp_path / "worker.log"
    assert entry.log_path(["--state-dir", str(tmp_path), "--server", "x"]) == log
    assert entry.log_path([f"--state-dir={tmp_path}"]) == log
    assert entry.log_path([]) == Path.home() / ".idlegrid" / "worker" / "worker.log"
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "stderr", None)
    entry.ensure_streams(["--state-dir", str(tmp_path / "state")])
    assert sys.stderr is not None and sys.stdout is not None
    assert not sys.stderr.isatty()  # what the worker's logging setup asks first
    print("kept in the log")
    sys.stderr.close()
    assert (tmp_path / "state" / "worker.log").read_text() == "kept in the log\n"
    sys.stdout.close()
