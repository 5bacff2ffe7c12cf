"""Install the worker to start by itself: systemd on Linux, launchd on macOS, Task
Scheduler on Windows. The files are made by pure functions (unit-tested on every
platform); `install` writes them and asks the platform's manager to start them.

The node token is never on a command line (where `ps` shows it): `install` writes it to
`node-token` in the state directory, readable by its owner only, and the worker reads it
from there.

The systemd unit runs at nice 10 and the idle I/O class, and has no PrivateTmp (or
DynamicUser, which implies it): a private /tmp hides /tmp/.X11-unix, and with it the X
server that the XScreenSaver probe asks. The user unit runs as the volunteer, in their
session's environment; the system unit as a dedicated `idlegrid` account in the `input`
group, so the input-device probe can read keyboards and mice.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from idlegrid.worker import desktop_files

UNIT = "idlegrid-worker.service"
LAUNCHD_LABEL = "org.idlegrid.worker"
TASK_NAME = "idlegrid-worker"
TOKEN_FILE = "node-token"
SYSTEM_USER = "idlegrid"
SYSTEM_STATE_DIR = Path("/var/lib/idlegrid-worker")
# Options that go into the service's command line when the volunteer gave them.
PASSED_OPTIONS = (
    "name", "slots", "prefetch", "kinds", "device", "threads", "cpu_mode", "gpu_mode",
    "idle_after_s", "cpu_cores", "cpu_percent", "in_use_cpu_percent", "memory_percent",
    "suspend_cpu_usage", "suspend_gpu_usage", "min_battery_percent", "windows",
    "max_cpu_temp_c", "control_port", "p2p_reachability", "sequences",
)  # fmt: skip
FLAG_NAMES = {"idle_after_s": "--idle-after", "max_cpu_temp_c": "--max-cpu-temp"}
# What the one-file build makes besides the console program (packaging/build_worker.py;
# tests/worker/test_worker_build_recipe.py keeps the two alike): the tray program, on
# macOS inside the app bundle.
TRAY_PROGRAM = "idlegrid-worker-tray"
TRAY_APP = "idlegrid worker.app"


class ServiceError(Exception):
    """Installing or removing the service failed; the message says what to do."""


def worker_command(executable: str | None = None, *, frozen: bool | None = None) -> list[str]:
    """How to start `idlegrid worker` again: this Python, or this one-file binary
    (`executable` and `frozen` stand for `sys.executable` and `sys.frozen` in tests)."""
    executable = sys.executable if executable is None else executable
    if _frozen() if frozen is None else frozen:  # the PyInstaller build is the worker
        return [executable]
    return [executable, "-m", "idlegrid", "worker"]


def service_command(
    *, platform: str, executable: str | None = None, frozen: bool | None = None
) -> list[str]:
    """What the service starts (the daemon's flags follow): `worker_command`, except on
    Windows, whose logon task runs in the volunteer's session, so a console program would
    open a console window at every logon that closing stops the worker: there the
    one-file build's windowless `idlegrid-worker-tray.exe` beside it runs the daemon (with
    arguments it is `idlegrid worker ...`, packaging/tray_entry.py)."""
    frozen = _frozen() if frozen is None else frozen
    command = worker_command(executable, frozen=frozen)
    if frozen and platform == "win32":
        windowless = tray_program(Path(command[0]), platform=platform, home=Path.home())
        if windowless is not None:
            return [str(windowless)]
    return command


def tray_program(executable: Path, *, platform: str, home: Path) -> Path | None:
    """The tray program that the one-file build makes beside the console program at
    `executable`, or None where there is none (Linux, or a copy moved away from it).

    macOS: the executable inside `idlegrid worker.app`: this program when it runs from the
    bundle, else the bundle beside it, in ~/Applications or in /Applications. Windows:
    `idlegrid-worker-tray.exe` beside it."""
    if platform == "darwin":
        if _in_app_bundle(executable):
            return executable
        for folder in (executable.parent, home / "Applications", Path("/Applications")):
            candidate = folder / TRAY_APP / "Contents" / "MacOS" / TRAY_PROGRAM
            if candidate.is_file():
                return candidate
    elif platform == "win32":
        candidate = executable.with_name(f"{TRAY_PROGRAM}.exe")
        if candidate.is_file():
            return candidate
    return None


def _in_app_bundle(executable: Path) -> bool:
    """`NAME.app/Contents/MacOS/program`: a program that runs from a macOS app bundle."""
    parts = executable.parts
    return len(parts) > 3 and parts[-3:-1] == ("Contents", "MacOS") and parts[-4].endswith(".app")


def tray_command(
    *, platform: str, home: Path, executable: str | None = None, frozen: bool | None = None
) -> list[str]:
    """What the tray's login entry starts (its options and `tray` follow): the build's
    tray program where it made one, else this worker (`idlegrid worker ... tray`).

    On macOS that is the bundle's own executable, not `open -a`, which would end at once:
    launchd then holds the tray's process, and the tray gets its options. On Windows the
    tray program has no console window of its own."""
    frozen = _frozen() if frozen is None else frozen
    command = worker_command(executable, frozen=frozen)
    if not frozen:  # the Python package: its tray is `idlegrid worker tray`
        return command
    tray = tray_program(Path(command[0]), platform=platform, home=home)
    return [str(tray)] if tray is not None else command


def daemon_arguments(options: dict[str, Any]) -> list[str]:
    """The worker's flags from the options the volunteer gave `install`."""
    args: list[str] = []
    for server in options.get("servers") or ():
        args += ["--server", server]
    for name in PASSED_OPTIONS:
        value = options.get(name)
        if value is None or value == "" or (value == 0 and name != "control_port"):
            continue
        args += [FLAG_NAMES.get(name, "--" + name.replace("_", "-")), str(value)]
    for app in options.get("exclusive_apps") or ():
        args += ["--exclusive-app", app]
    if options.get("dedicated"):
        args.append("--dedicated")
    if options.get("run_on_battery"):
        args.append("--run-on-battery")
    return args


# -- the files ---------------------------------------------------------------------------


def systemd_unit(
    command: Sequence[str],
    *,
    system: bool,
    state_dir: Path,
    environment_file: Path | None = None,
    needs: Path | None = None,
) -> str:
    """The unit. `environment_file`: IDLEGRID_* settings to read (the package's
    /etc/default file); `needs`: a file without which it does not start (the token)."""
    condition = f"ConditionPathExists={needs}\n" if needs else ""
    environment = f"EnvironmentFile=-{environment_file}\n" if environment_file else ""
    account = (
        f"User={SYSTEM_USER}\nGroup={SYSTEM_USER}\nSupplementaryGroups=input\n"
        f"StateDirectory={SYSTEM_STATE_DIR.name}\nStateDirectoryMode=2750\n"
        if system
        else ""
    )
    return f"""[Unit]
Description=idlegrid worker: computes for a grid while this machine is idle
Documentation=https://github.com/idlegrid/idlegrid/blob/main/docs/worker.md
After=network-online.target
Wants=network-online.target
{condition}
[Service]
Type=simple
{account}ExecStart={shlex.join([*command, "--state-dir", str(state_dir)])}
Environment=PYTHONUNBUFFERED=1
{environment}Nice=10
IOSchedulingClass=idle
Restart=on-failure
RestartSec=10
# SIGTERM to the daemon, which gives its running tasks back to the coordinator and ends
# its task processes; SIGKILL to what is left.
KillMode=mixed
TimeoutStopSec=30
NoNewPrivileges=yes
# No PrivateTmp=: a private /tmp hides /tmp/.X11-unix from the XScreenSaver probe.

[Install]
WantedBy={"multi-user.target" if system else "default.target"}
"""


def launchd_plist(command: Sequence[str], *, state_dir: Path, log_dir: Path) -> str:
    """`~/Library/LaunchAgents/org.idlegrid.worker.plist`: the worker as the user's agent,
    restarted when it fails, at background priority."""
    log = str(log_dir / "worker.log")
    return desktop_files.plist({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [*command, "--state-dir", str(state_dir)],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ProcessType": "Background",
        "Nice": 10,
        "LowPriorityIO": True,
        "StandardOutPath": log,
        "StandardErrorPath": log,
    })  # fmt: skip


def task_scheduler_xml(command: Sequence[str], *, state_dir: Path, user: str) -> str:
    """A logon task in the volunteer's own session, so GetLastInputInfo sees their input
    (a session-0 service would need `idlegrid worker idle-helper` in the session)."""
    parts = [*command, "--state-dir", str(state_dir)]
    program, arguments = parts[0], parts[1:]
    args = subprocess.list2cmdline(arguments)
    return f"""<?xml version="1.0" encoding="UTF-16"?>
<Task version="1.2" xmlns="http://schemas.microsoft.com/windows/2004/02/mit/task">
  <RegistrationInfo>
    <Description>idlegrid worker: computes for a grid while this machine is idle</Description>
  </RegistrationInfo>
  <Triggers>
    <LogonTrigger>
      <Enabled>true</Enabled>
      <UserId>{escape(user)}</UserId>
    </LogonTrigger>
  </Triggers>
  <Principals>
    <Principal id="Author">
      <UserId>{escape(user)}</UserId>
      <LogonType>InteractiveToken</LogonType>
      <RunLevel>LeastPrivilege</RunLevel>
    </Principal>
  </Principals>
  <Settings>
    <MultipleInstancesPolicy>IgnoreNew</MultipleInstancesPolicy>
    <DisallowStartIfOnBatteries>false</DisallowStartIfOnBatteries>
    <StopIfGoingOnBatteries>false</StopIfGoingOnBatteries>
    <ExecutionTimeLimit>PT0S</ExecutionTimeLimit>
    <Priority>7</Priority>
    <RestartOnFailure>
      <Interval>PT1M</Interval>
      <Count>999</Count>
    </RestartOnFailure>
  </Settings>
  <Actions Context="Author">
    <Exec>
      <Command>{escape(program)}</Command>
      <Arguments>{escape(args)}</Arguments>
    </Exec>
  </Actions>
</Task>
"""


# -- install and uninstall ---------------------------------------------------------------


def write_token(state_dir: Path, token: str) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    os.chmod(path, 0o600)
    return path


def install(
    options: dict[str, Any], *, system: bool, dry_run: bool, platform: str = sys.platform
) -> list[str]:
    """Write the service file (and the token), enable and start it; lines to print."""
    arguments = daemon_arguments(options)
    command = [*service_command(platform=platform), *arguments]
    if system:
        state_dir = SYSTEM_STATE_DIR
    else:
        state_dir = Path(options.get("state_dir") or Path.home() / ".idlegrid" / "worker")
    state_dir = state_dir.expanduser().resolve()
    path, text, steps = _service_file(
        command, system=system, state_dir=state_dir, platform=platform
    )
    # The tray at login and the app in the menu, for the user's own install.
    desktop = [] if system else _desktop_files(state_dir, platform)
    if platform == "darwin":  # the tray now, not only from the next login on
        steps = (*steps, *(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(where)]
                           for where, _ in desktop))  # fmt: skip
    if dry_run:
        shown = [line for where, content in desktop for line in (f"# {where}", content)]
        steps_shown = [f"# then: {shlex.join(step)}" for step in steps]
        return [f"# {path}", text, *steps_shown, *shown, *([] if system else _tray_note(platform))]
    if system and platform.startswith("linux"):
        _ensure_system_user()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-16" if platform == "win32" else "utf-8")
    token_path = write_token(state_dir, options["token"])
    if system and platform.startswith("linux"):
        shutil.chown(token_path, SYSTEM_USER, SYSTEM_USER)
    for where, content in desktop:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(content, encoding="utf-16" if platform == "win32" else "utf-8")
    for step in steps:
        _run(step)
    wrote = [f"wrote {where}" for where, _ in desktop]
    notes = [] if system else _tray_note(platform)
    return [f"wrote {path}", f"wrote {token_path}", *wrote, f"started {TASK_NAME}", *notes]


def _service_file(
    command: list[str], *, system: bool, state_dir: Path, platform: str
) -> tuple[Path, str, tuple[list[str], ...]]:
    """The service file of `platform`'s service manager: its path, its text and the
    commands that enable and start it."""
    if platform.startswith("linux"):
        path = _systemd_path(system)
        text = systemd_unit(command, system=system, state_dir=state_dir)
        steps: tuple[list[str], ...] = (
            _systemctl(system, "daemon-reload"),
            _systemctl(system, "enable", "--now", UNIT),
        )
    elif platform == "darwin":
        if system:
            raise ServiceError("on macOS the worker installs as the user's launchd agent only")
        path = Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        text = launchd_plist(command, state_dir=state_dir, log_dir=state_dir)
        steps = (["launchctl", "bootstrap", f"gui/{os.getuid()}", str(path)],)
    elif platform == "win32":
        path = state_dir / f"{TASK_NAME}.xml"
        user = os.environ.get("USERDOMAIN", "") + "\\" + os.environ.get("USERNAME", "")
        text = task_scheduler_xml(command, state_dir=state_dir, user=user)
        steps = (["schtasks", "/Create", "/TN", TASK_NAME, "/XML", str(path), "/F"],)
    else:
        raise ServiceError(f"no service manager known for {platform}")
    return path, text, steps


def _desktop_files(state_dir: Path, platform: str) -> list[tuple[Path, str]]:
    options = ["--state-dir", str(state_dir)]
    tray = tray_command(platform=platform, home=Path.home())
    return desktop_files.user_files(
        [*worker_command(), *options],
        tray_command=[*tray, *options],
        platform=platform,
        home=Path.home(),
        environ=os.environ,
    )


def _tray_note(platform: str) -> list[str]:
    """A line for `install` to print when the build's tray program was not found."""
    if not _frozen() or platform not in ("darwin", "win32"):
        return []
    if tray_program(Path(sys.executable), platform=platform, home=Path.home()) is not None:
        return []
    made = TRAY_APP if platform == "darwin" else f"{TRAY_PROGRAM}.exe"
    return [
        f"note: no {made} found beside {sys.executable}; the tray at login starts this "
        "console program instead (put the two together and install again)"
    ]


def _frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def uninstall(*, system: bool, platform: str = sys.platform) -> list[str]:
    """Stop and remove the service (the state directory, with the node's identity, stays)."""
    if platform.startswith("linux"):
        path = _systemd_path(system)
        _run(_systemctl(system, "disable", "--now", UNIT), check=False)
        path.unlink(missing_ok=True)
        _run(_systemctl(system, "daemon-reload"), check=False)
    elif platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        for label in (LAUNCHD_LABEL, *([] if system else [desktop_files.TRAY_LAUNCHD_LABEL])):
            _run(["launchctl", "bootout", f"gui/{os.getuid()}/{label}"], check=False)
        path.unlink(missing_ok=True)
    elif platform == "win32":
        path = Path(TASK_NAME)
        _run(["schtasks", "/Delete", "/TN", TASK_NAME, "/F"], check=False)
    else:
        raise ServiceError(f"no service manager known for {platform}")
    removed = [path]
    if not system:
        for where, _ in _desktop_files(Path.home(), platform):
            where.unlink(missing_ok=True)
            removed.append(where)
    return [f"removed {where}" for where in removed]


def _systemd_path(system: bool) -> Path:
    if system:
        return Path("/etc/systemd/system") / UNIT
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "systemd" / "user" / UNIT


def _systemctl(system: bool, *args: str) -> list[str]:
    return ["systemctl", *([] if system else ["--user"]), *args]


def _ensure_system_user() -> None:
    if os.geteuid() != 0:
        raise ServiceError("installing the system service needs root (sudo)")
    if subprocess.run(["id", SYSTEM_USER], capture_output=True).returncode != 0:
        _run(["useradd", "--system", "--home-dir", str(SYSTEM_STATE_DIR), "--shell",
              "/usr/sbin/nologin", "--groups", "input", SYSTEM_USER])  # fmt: skip


def _run(command: list[str], *, check: bool = True) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        if check:
            raise ServiceError(f"{command[0]} is not installed here") from None
        return
    if check and done.returncode != 0:
        raise ServiceError(f"{shlex.join(command)} failed: {done.stderr.strip() or done.stdout}")
