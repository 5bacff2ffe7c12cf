"""The local control page's files: its token readable by the owner only (0600, whatever
the umask), or by the group of a setgid state directory (the Debian package's, for the
desktop user's tray), both files written whole or not at all."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from idlegrid.worker.control import TOKEN_FILE, control_token, write_atomically

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("directory", "expected"), [(0o755, 0o600), (0o2770, 0o640)])
def test_the_token_is_the_owners_or_a_setgid_directorys_group(
    tmp_path: Path, directory: int, expected: int
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, directory)
    previous = os.umask(0)  # a umask that would leave it open to all
    try:
        token = control_token(state)
    finally:
        os.umask(previous)
    assert _mode(state / TOKEN_FILE) == expected
    assert control_token(state) == token  # made once
    assert [p.name for p in state.iterdir()] == [TOKEN_FILE]  # no scratch file left


def test_a_group_readable_token_is_made_private(tmp_path: Path) -> None:
    (tmp_path / TOKEN_FILE).write_text("kept\n")
    os.chmod(tmp_path / TOKEN_FILE, 0o640)
    assert control_token(tmp_path) == "kept"
    assert _mode(tmp_path / TOKEN_FILE) == 0o600


def test_an_empty_token_file_is_made_again(tmp_path: Path) -> None:
    (tmp_path / TOKEN_FILE).write_text("")  # what a crash mid-write used to leave
    token = control_token(tmp_path)
    assert len(token) >= 24 and (tmp_path / TOKEN_FILE).read_text().strip() == token


def test_an_atomic_write_replaces_whole_or_keeps_what_is_there(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    assert write_atomically(path, json.dumps({"url": "a"}), mode=0o644)
    assert write_atomically(path, json.dumps({"url": "b"}), mode=0o644)
    assert json.loads(path.read_text()) == {"url": "b"} and _mode(path) == 0o644
    assert not write_atomically(path, "other", mode=0o600, replace=False)
    assert json.loads(path.read_text()) == {"url": "b"}
    assert [p.name for p in tmp_path.iterdir()] == ["control.json"]
