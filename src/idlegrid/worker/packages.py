"""The Debian package of the one-file worker: its file tree and maintainer scripts.

`scripts/build-deb.sh` calls `debian_tree` and then `dpkg-deb`. The package carries the
binary as `/usr/bin/idlegrid-worker`, a system service (its own `idlegrid` account,
nice 10, idle I/O), the tray's XDG autostart entry, the app window's menu entry, a man
page, and a note after installation on adding the node token. What the volunteer's node
made (its identity, token, blob cache and the outbox) lives in `/var/lib/idlegrid-worker`:
removing the package keeps it, purging removes it unless finished results still wait
in the outbox. Before removal the outbox is delivered (`idlegrid-worker deliver`), and
what the coordinator could not take is kept and reported.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from idlegrid.worker import desktop_files, service
from idlegrid.worker.tray_view import icon_image

PACKAGE = "idlegrid-worker"
BINARY = Path("/usr/bin") / PACKAGE
STATE_DIR = service.SYSTEM_STATE_DIR
DEFAULTS = Path("/etc/default") / PACKAGE
UNIT_PATH = Path("/lib/systemd/system") / service.UNIT
ACCOUNT = service.SYSTEM_USER

NOTE = f"""\
idlegrid-worker is installed. To join a grid, give this node its token (the dashboard's
"add a node" page makes one; an admin: idlegrid token create --node --account NAME):

  1. the coordinator's address: set IDLEGRID_SERVER in {DEFAULTS}
       sudoedit {DEFAULTS}
  2. the node token (paste it, then press Enter and Ctrl-D):
       sudo install -m 600 -o {ACCOUNT} -g {ACCOUNT} /dev/stdin {STATE_DIR}/node-token
  3. start the service:
       sudo systemctl restart {service.UNIT}

The tray icon starts at your next login. It, the app window ({PACKAGE} app) and
`{PACKAGE} status` read the service's control page, which members of the {ACCOUNT}
group may use: sudo adduser $USER {ACCOUNT} (then log in again).
See man {PACKAGE}.
"""

DEFAULTS_TEXT = """\
# Settings of the idlegrid worker service: IDLEGRID_* variables (man idlegrid-worker).
# The coordinator to connect to (a comma list for fail-over):
#IDLEGRID_SERVER=https://grid.example
# Examples of the idle policy's settings:
#IDLEGRID_CPU_PERCENT=50
#IDLEGRID_WINDOWS=18:00-08:00; sat,sun 00:00-24:00
# Seconds to try delivering finished results before the package is removed:
#IDLEGRID_DELIVER_TIMEOUT_S=60
"""

POSTINST = f"""#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent passwd {ACCOUNT} >/dev/null; then
        useradd --system --user-group --home-dir {STATE_DIR} --no-create-home \\
            --shell /usr/sbin/nologin --comment "idlegrid worker" {ACCOUNT}
    fi
    # The input-device idle probe reads keyboards and mice.
    if getent group input >/dev/null; then usermod -a -G input {ACCOUNT}; fi
    install -d -o {ACCOUNT} -g {ACCOUNT} -m 2750 {STATE_DIR}
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
        systemctl enable {service.UNIT} >/dev/null 2>&1 || true
        if [ -s {STATE_DIR}/node-token ]; then systemctl restart {service.UNIT} || true; fi
    fi
    if [ ! -s {STATE_DIR}/node-token ]; then
        cat <<'NOTE'
{NOTE}NOTE
    fi
fi
exit 0
"""

# Before removal: stop the service (SIGTERM gives its running tasks back to the
# coordinator), then deliver the finished results still in the outbox. Results the
# coordinator cannot take now stay where they are, and `deliver` says so.
PRERM = f"""#!/bin/sh
set -e
if [ "$1" = remove ]; then
    if [ -d /run/systemd/system ]; then
        systemctl stop {service.UNIT} || true
        systemctl disable {service.UNIT} >/dev/null 2>&1 || true
    fi
    if ls {STATE_DIR}/outbox/*.json >/dev/null 2>&1; then
        (
            set -a
            if [ -r {DEFAULTS} ]; then . {DEFAULTS}; fi
            set +a
            runuser -u {ACCOUNT} -- {BINARY} --state-dir {STATE_DIR} \\
                deliver --timeout "${{IDLEGRID_DELIVER_TIMEOUT_S:-60}}"
        ) || true
    fi
fi
exit 0
"""

POSTRM = f"""#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
if [ "$1" = purge ]; then
    if ls {STATE_DIR}/outbox/*.json >/dev/null 2>&1; then
        echo "idlegrid-worker: {STATE_DIR} is kept: its outbox holds finished results" \\
            "that no coordinator took yet (install the worker again to deliver them)"
    else
        rm -rf {STATE_DIR}
        if getent passwd {ACCOUNT} >/dev/null; then userdel {ACCOUNT} || true; fi
        if getent group {ACCOUNT} >/dev/null; then groupdel {ACCOUNT} || true; fi
    fi
fi
exit 0
"""


def control_file(*, version: str, architecture: str, installed_kib: int) -> str:
    return f"""Package: {PACKAGE}
Version: {version}
Architecture: {architecture}
Maintainer: idlegrid developers <idlegrid@users.noreply.github.com>
Installed-Size: {installed_kib}
Depends: passwd, util-linux
Recommends: gir1.2-gtk-3.0, gir1.2-webkit2-4.1
Section: net
Priority: optional
Homepage: https://github.com/idlegrid/idlegrid
Description: idlegrid worker: computes for a grid while this machine is idle
 The worker of idlegrid, a pool of volunteer machines for machine-learning work.
 It connects out to a coordinator, runs only the task kinds built into it, and
 steps aside within a second when the machine's owner comes back. It runs as a
 system service of its own account, with a tray icon and an app window for the
 owner.
"""


def _write(root: Path, path: Path, content: str | bytes, mode: int = 0o644) -> None:
    target = root / path.relative_to("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content.encode() if isinstance(content, str) else content)
    target.chmod(mode)


def debian_tree(
    root: Path, *, binary: Path, man_page: Path, version: str, architecture: str
) -> Path:
    """Lay out the package's files under `root` (made empty first); returns `root`."""
    if root.exists():
        shutil.rmtree(root)
    command = [str(BINARY), "--state-dir", str(STATE_DIR)]
    _write(root, BINARY, binary.read_bytes(), 0o755)
    unit = service.systemd_unit(
        [str(BINARY)], system=True, state_dir=STATE_DIR,
        environment_file=DEFAULTS, needs=STATE_DIR / service.TOKEN_FILE,
    )  # fmt: skip
    _write(root, UNIT_PATH, unit)
    _write(root, DEFAULTS, DEFAULTS_TEXT)
    autostart = desktop_files.xdg_autostart_entry(command)
    _write(root, Path("/etc/xdg/autostart") / desktop_files.AUTOSTART_FILE, autostart)
    menu = desktop_files.app_menu_entry(command)
    _write(root, Path("/usr/share/applications") / desktop_files.APP_MENU_FILE, menu)
    icon = Path(f"/usr/share/icons/hicolor/64x64/apps/{desktop_files.ICON_NAME}.png")
    icon_path = root / icon.relative_to("/")
    icon_path.parent.mkdir(parents=True, exist_ok=True)
    icon_image("running").save(icon_path)
    manual = gzip.compress(man_page.read_bytes(), compresslevel=9, mtime=0)
    _write(root, Path(f"/usr/share/man/man1/{PACKAGE}.1.gz"), manual)
    docs = Path("/usr/share/doc") / PACKAGE
    _write(root, docs / "copyright", _COPYRIGHT)
    _write(root, docs / "README.Debian", NOTE)
    installed_kib = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) // 1024 + 1
    debian = root / "DEBIAN"
    debian.mkdir()
    (debian / "control").write_text(
        control_file(version=version, architecture=architecture, installed_kib=installed_kib)
    )
    (debian / "conffiles").write_text(f"{DEFAULTS}\n")
    for name, script in (("postinst", POSTINST), ("prerm", PRERM), ("postrm", POSTRM)):
        (debian / name).write_text(script)
        (debian / name).chmod(0o755)
    return root


_COPYRIGHT = """\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: idlegrid
Source: https://github.com/idlegrid/idlegrid

Files: *
Copyright: the idlegrid developers
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
"""


def main() -> None:
    """`python -m idlegrid.worker.packages ROOT BINARY MAN_PAGE VERSION ARCH`."""
    import sys

    root, binary, man_page, version, architecture = sys.argv[1:6]
    debian_tree(
        Path(root), binary=Path(binary), man_page=Path(man_page),
        version=version, architecture=architecture,
    )  # fmt: skip


if __name__ == "__main__":
    main()
