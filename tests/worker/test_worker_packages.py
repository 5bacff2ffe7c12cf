"""The files that install the worker as an app: the tray's login entries on Linux, macOS
and Windows, the app window's menu entry, and the Debian package's tree and scripts.
Pure functions, tested here on every platform; tests/worker/test_worker_deb.py installs
the real package."""

from __future__ import annotations

import configparser
import os
import plistlib
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from idlegrid.worker import desktop_files, packages, service

COMMAND = ["/usr/bin/idlegrid-worker", "--state-dir", "/var/lib/idlegrid-worker"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argument", "written"),
    [
        ("/usr/bin/idlegrid-worker", "/usr/bin/idlegrid-worker"),
        ("/home/ann/my grid", '"/home/ann/my grid"'),
        ('say "hi"', '"say \\\\"hi\\\\""'),
        ("$HOME", '"\\\\$HOME"'),
        ("50%", "50%%"),
        ("", '""'),
    ],
)
def test_exec_lines_quote_as_the_desktop_entry_spec_says(argument: str, written: str) -> None:
    assert desktop_files.exec_line(["run", argument]) == f"run {written}"


def _entry(text: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser["Desktop Entry"]


def test_the_tray_starts_at_login_and_the_app_is_in_the_menu() -> None:
    autostart = _entry(desktop_files.xdg_autostart_entry(COMMAND))
    assert autostart["Type"] == "Application" and autostart["Terminal"] == "false"
    assert autostart["Exec"] == " ".join([*COMMAND, "tray"])
    menu = _entry(desktop_files.app_menu_entry(COMMAND))
    assert menu["Exec"] == " ".join([*COMMAND, "app"])
    assert "NoDisplay" not in menu and menu["Categories"].endswith(";")


def test_the_macos_tray_agent_and_the_windows_startup_script() -> None:
    agent = plistlib.loads(desktop_files.tray_launch_agent(COMMAND).encode())
    assert agent["Label"] == desktop_files.TRAY_LAUNCHD_LABEL != service.LAUNCHD_LABEL
    assert agent["ProgramArguments"] == [*COMMAND, "tray"]
    assert agent["RunAtLoad"] is True and agent["LimitLoadToSessionType"] == "Aqua"
    script = desktop_files.windows_startup_script(
        [r"C:\Program Files\idlegrid\idlegrid-worker.exe", "--state-dir", r"C:\Users\ann\ig"]
    )
    # VBScript doubles the quotes inside a string; 0 hides the console window.
    line = r'"""C:\Program Files\idlegrid\idlegrid-worker.exe"" --state-dir C:\Users\ann\ig tray"'
    assert f'CreateObject("WScript.Shell").Run {line}, 0, False\r\n' in script


@pytest.mark.parametrize(
    ("platform", "environ", "expected"),
    [
        ("linux", {}, ["/home/ann/.config/autostart/idlegrid-tray.desktop",
                       "/home/ann/.local/share/applications/idlegrid-worker.desktop"]),
        ("linux", {"XDG_CONFIG_HOME": "/cfg", "XDG_DATA_HOME": "/data"},
         ["/cfg/autostart/idlegrid-tray.desktop", "/data/applications/idlegrid-worker.desktop"]),
        ("darwin", {}, ["/home/ann/Library/LaunchAgents/org.idlegrid.tray.plist"]),
        ("win32", {"APPDATA": "/roaming"},
         ["/roaming/Microsoft/Windows/Start Menu/Programs/Startup/idlegrid-tray.vbs"]),
        ("sunos5", {}, []),
    ],
)  # fmt: skip
def test_where_the_user_install_puts_the_tray(
    platform: str, environ: dict[str, str], expected: list[str]
) -> None:
    files = desktop_files.user_files(
        COMMAND, platform=platform, home=Path("/home/ann"), environ=environ
    )
    assert [str(path) for path, _ in files] == expected


@pytest.mark.parametrize(
    ("platform", "entry"),
    [("linux", "idlegrid-tray.desktop"), ("darwin", "org.idlegrid.tray.plist"),
     ("win32", "idlegrid-tray.vbs")],
)  # fmt: skip
def test_the_user_install_adds_the_tray_at_login(tmp_path: Path, platform: str, entry: str) -> None:
    options = {"token": "ign_secret", "servers": ("https://grid.example",), "state_dir": tmp_path}
    lines = service.install(options, system=False, dry_run=True, platform=platform)
    text = "\n".join(lines)
    assert f"{entry}\n" in text + "\n"
    assert _tray_entry(lines, platform)[-3:] == ["--state-dir", str(tmp_path), "tray"]
    if platform == "darwin":  # started now too, not only at the next login
        assert f"# then: launchctl bootstrap gui/{os.getuid()} " in text
        assert text.count("launchctl bootstrap") == 2 and f"{entry}\n" in text
    system = "\n".join(service.install(options, system=True, dry_run=True, platform="linux"))
    assert "tray" not in system  # the package installs the system-wide entry


# The tray's login entry by system and by how the worker was installed: `pip` (Python),
# or the one-file build (`frozen`) with its tray program beside the console program, in
# the app bundle it runs from, in ~/Applications, or nowhere to be found.
TRAY_ENTRIES = [
    ("linux", "pip", None),
    ("linux", "frozen", "console"),
    ("darwin", "pip", None),
    ("darwin", "beside", "dist/idlegrid worker.app/Contents/MacOS/idlegrid-worker-tray"),
    ("darwin", "in-bundle", "dist/idlegrid worker.app/Contents/MacOS/idlegrid-worker-tray"),
    ("darwin", "applications",
     "home/Applications/idlegrid worker.app/Contents/MacOS/idlegrid-worker-tray"),
    ("darwin", "alone", "console"),
    ("win32", "pip", None),
    ("win32", "beside", "dist/idlegrid-worker-tray.exe"),
    ("win32", "alone", "console"),
]  # fmt: skip


def _installed(tmp_path: Path, platform: str, layout: str) -> str | None:
    """Lay out the build as `layout` says; the console program's path (None: pip)."""
    if layout == "pip":
        return None
    suffix = ".exe" if platform == "win32" else ""
    console = tmp_path / "dist" / f"idlegrid-worker{suffix}"
    app = Path("Applications") if layout == "applications" else Path()
    tray = {
        "darwin": tmp_path / ("home" if layout == "applications" else "dist") / app
        / "idlegrid worker.app/Contents/MacOS/idlegrid-worker-tray",
        "win32": tmp_path / "dist/idlegrid-worker-tray.exe",
    }.get(platform)  # fmt: skip
    for program in [console] + ([tray] if tray and layout != "alone" else []):
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_bytes(b"program")
    running = tray if layout == "in-bundle" else console
    return str(running)


def _tray_entry(lines: list[str], platform: str) -> list[str]:
    """The tray's login entry in `install --dry-run`'s output, as the command it starts."""
    name = {"linux": "idlegrid-tray.desktop", "darwin": "org.idlegrid.tray.plist",
            "win32": "idlegrid-tray.vbs"}[platform]  # fmt: skip
    where = next(line for line in lines if line.endswith(name) and not line.startswith("# then:"))
    text = lines[lines.index(where) + 1]
    if platform == "linux":
        return _entry(text)["Exec"].split()  # no spaces in these paths
    if platform == "darwin":
        return list(plistlib.loads(text.encode())["ProgramArguments"])
    # Run with window style 0: started hidden, with no console window.
    line = text.split('CreateObject("WScript.Shell").Run "')[1]
    assert line.endswith('", 0, False\r\n')
    return shlex.split(line.removesuffix('", 0, False\r\n').replace('""', '"'))


@pytest.mark.parametrize(
    ("platform", "layout", "tray"), TRAY_ENTRIES, ids=[f"{p}-{w}" for p, w, _ in TRAY_ENTRIES]
)
def test_the_tray_at_login_starts_the_tray_program_the_build_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, platform: str, layout: str, tray: str | None
) -> None:
    running = _installed(tmp_path, platform, layout)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if running is not None:
        monkeypatch.setattr(sys, "frozen", True, raising=False)
        monkeypatch.setattr(sys, "executable", running)
    state = tmp_path / "state"
    options = {"token": "ign_secret", "servers": ("https://grid.example",), "state_dir": state}
    lines = service.install(options, system=False, dry_run=True, platform=platform)
    if tray is None:  # pip: this Python, `idlegrid worker ... tray`
        program = [sys.executable, "-m", "idlegrid", "worker"]
    else:
        program = [str(tmp_path / "dist" / "idlegrid-worker") if tray == "console"
                   else str(tmp_path / tray)]  # fmt: skip
        if platform == "win32" and tray == "console":
            program = [program[0] + ".exe"]
    assert _tray_entry(lines, platform) == [*program, "--state-dir", str(state), "tray"]
    noted = [line for line in lines if line.startswith("note: ")]
    assert bool(noted) == (tray == "console" and platform != "linux"), noted
    if platform == "darwin" and running is not None:  # the worker itself: as it was started
        agent = lines[lines.index(next(x for x in lines if x.endswith("worker.plist"))) + 1]
        assert plistlib.loads(agent.encode())["ProgramArguments"][0] == running


def _tree(tmp_path: Path) -> Path:
    binary = tmp_path / "idlegrid-worker"
    binary.write_bytes(b"\x7fELF" + b"\0" * 4096)
    return packages.debian_tree(
        tmp_path / "root", binary=binary, man_page=ROOT / "packaging/linux/idlegrid-worker.1",
        version="1.2.3", architecture="amd64",
    )  # fmt: skip


def test_the_debian_tree_has_the_service_the_entries_and_the_manual(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert (root / "usr/bin/idlegrid-worker").stat().st_mode & 0o777 == 0o755
    unit = (root / "lib/systemd/system/idlegrid-worker.service").read_text()
    for line in ("User=idlegrid", "Nice=10", "IOSchedulingClass=idle",
                 "ExecStart=/usr/bin/idlegrid-worker --state-dir /var/lib/idlegrid-worker",
                 "EnvironmentFile=-/etc/default/idlegrid-worker", "StateDirectoryMode=2750",
                 "ConditionPathExists=/var/lib/idlegrid-worker/node-token"):  # fmt: skip
        assert f"{line}\n" in unit, line
    autostart = _entry((root / "etc/xdg/autostart/idlegrid-tray.desktop").read_text())
    assert autostart["Exec"] == "/usr/bin/idlegrid-worker --state-dir /var/lib/idlegrid-worker tray"
    assert (root / "usr/share/applications/idlegrid-worker.desktop").is_file()
    assert (root / "usr/share/icons/hicolor/64x64/apps/idlegrid-worker.png").is_file()
    assert (root / "usr/share/man/man1/idlegrid-worker.1.gz").is_file()
    control = (root / "DEBIAN/control").read_text()
    assert "Package: idlegrid-worker\nVersion: 1.2.3\nArchitecture: amd64\n" in control
    assert int(control.split("Installed-Size: ")[1].split()[0]) >= 4
    assert (root / "DEBIAN/conffiles").read_text() == "/etc/default/idlegrid-worker\n"


@pytest.mark.parametrize("script", ["postinst", "prerm", "postrm"])
def test_the_maintainer_scripts_are_valid_shell(tmp_path: Path, script: str) -> None:
    path = _tree(tmp_path) / "DEBIAN" / script
    assert path.stat().st_mode & 0o111
    done = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_removal_delivers_the_outbox_and_purge_keeps_undelivered_results() -> None:
    assert "deliver --timeout" in packages.PRERM and "runuser -u idlegrid" in packages.PRERM
    keep, remove = packages.POSTRM.split("else", 1)
    assert "outbox/*.json" in keep and "rm -rf /var/lib/idlegrid-worker" in remove
    assert "node-token" in packages.NOTE and "IDLEGRID_SERVER" in packages.NOTE
