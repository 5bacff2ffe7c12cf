"""/download: the packages a coordinator serves, their SHA-256, and the add-node commands
that use them with the node token kept in a private file."""

from __future__ import annotations

import hashlib
import html
import re
import shlex

from conftest import Api, off_loop
from test_dashboard import Browser, _set_login

from idlegrid import __version__
from idlegrid.dashboard.downloads import node_commands
from idlegrid.dashboard.shelf import Package, wanted

WHEEL = f"idlegrid-{__version__}-py3-none-any.whl"


def _shelve(api: Api, files: dict[str, bytes]) -> dict[str, str]:
    folder = api.settings.download_dir
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def test_the_download_page_lists_what_was_built_with_its_sha256(api: Api) -> None:
    sums = _shelve(
        api,
        {
            WHEEL: b"wheel bytes",
            "idlegrid-worker-linux-x86_64": b"\x7fELF binary",
            "idlegrid-0.0.1-py3-none-any.whl": b"an older version",
            ".idlegrid-worker-linux-aarch64.part": b"half a copy",
            "notes.txt": b"not a package",
        },
    )
    page = api.client.get("/download")
    assert page.status_code == 200
    listed = re.findall(r'<a href="/download/([^"]+)">', page.text)
    assert sorted(listed) == sorted([WHEEL, "idlegrid-worker-linux-x86_64", "SHA256SUMS"])
    assert sums[WHEEL] in page.text and sums["idlegrid-worker-linux-x86_64"] in page.text
    # pip checks the wheel's hash, sha256sum the binary's.
    assert f"/download/{WHEEL}#sha256={sums[WHEEL]}" in page.text
    assert f"{sums['idlegrid-worker-linux-x86_64']}  idlegrid-worker" in page.text

    got = api.client.get(f"/download/{WHEEL}")
    assert got.status_code == 200 and got.content == b"wheel bytes"
    assert got.headers["x-checksum-sha256"] == sums[WHEEL]
    listing = api.client.get("/download/SHA256SUMS").text
    assert f"{sums[WHEEL]}  {WHEEL}\n" in listing and "older" not in listing

    # A changed file is hashed again.
    (api.settings.download_dir / WHEEL).write_bytes(b"a rebuilt wheel")
    assert hashlib.sha256(b"a rebuilt wheel").hexdigest() in api.client.get("/download").text


def test_a_package_not_built_is_answered_without_server_paths(api: Api) -> None:
    data_dir = str(api.settings.data_dir)
    page = api.client.get("/download")
    assert "No worker package is served here yet" in page.text
    assert data_dir not in page.text and "--data-dir" not in page.text
    assert api.client.get("/download/..%2Fidlegrid.db").status_code == 404
    for name in (WHEEL, "notes.txt", "idlegrid.db", "idlegrid-worker-linux-x86_64"):
        missing = api.client.get(f"/download/{name}")
        assert missing.status_code == 404, name
        assert missing.headers["content-type"].startswith("text/html")
        assert data_dir not in missing.text and "--data-dir" not in missing.text, name
    assert "not built on this coordinator yet" in api.client.get(f"/download/{WHEEL}").text
    assert "not a package this coordinator serves" in api.client.get("/download/notes.txt").text
    # The operator, signed in as an admin, is told how to build them, and where.
    off_loop(_set_login(api, "operator", "admin"))
    operator = Browser(api.client)
    assert operator.sign_in("operator").status_code == 303
    page = operator.get("/download")
    assert f"scripts/build-downloads.sh --data-dir {data_dir}" in html.unescape(page.text)


def test_with_nothing_built_add_a_node_names_no_source_checkout(api: Api) -> None:
    browser = Browser(api.client)
    browser.sign_up("nina")
    page = html.unescape(browser.post("/my/nodes/add", {"name": ""}).text)
    assert "serves no worker package yet" in page
    assert "checkout" not in page and 'pip install ".' not in page and "pip install -e" not in page
    commands = re.findall(r'<code class="command">([^<]+)</code>', page)
    assert len(commands) == 2  # saving the token and starting the worker; no install command
    assert "idlegrid worker --server http://testserver" in commands[1]


def test_add_node_commands_keep_the_token_off_the_command_line(api: Api) -> None:
    sums = _shelve(api, {WHEEL: b"wheel"})
    browser = Browser(api.client)
    browser.sign_up("nina")
    page = browser.post("/my/nodes/add", {"name": "nina's pc"})
    token = re.search(r'<code id="node-token">(ign_[^<]+)</code>', page.text)
    assert token is not None
    commands = [
        html.unescape(c) for c in re.findall(r'<code class="command">([^<]+)</code>', page.text)
    ]
    assert len(commands) == 3 and not any(token.group(1) in c for c in commands)
    install, save, start = (shlex.split(c) for c in commands)
    assert (
        install[-1] == f"idlegrid[worker] @ http://testserver/download/{WHEEL}#sha256={sums[WHEEL]}"
    )
    assert "umask 077" in commands[1] and "~/.idlegrid/node-token" in commands[1]
    assert start[:6] == [
        "idlegrid",
        "worker",
        "--server",
        "http://testserver",
        "--token-file",
        "~/.idlegrid/node-token",
    ]
    assert start[6:] == ["--name", "nina's pc"]


def test_which_files_are_served_and_which_commands_they_give() -> None:
    assert wanted(WHEEL) and wanted("idlegrid-worker-linux-aarch64")
    for name in ("idlegrid-0.0.1-py3-none-any.whl", ".x.part", "idlegrid.db", "admin-token"):
        assert not wanted(name), name
    binary = Package("idlegrid-worker-linux-x86_64", 10, "ab" * 32)
    only_binary = node_commands("http://c:8000", [binary])
    assert (
        "curl -fLo idlegrid-worker http://c:8000/download/idlegrid-worker-linux-x86_64"
        in (only_binary[0][1])
    )
    assert only_binary[-1][1].startswith("./idlegrid-worker --server http://c:8000 --token-file")
    nothing = node_commands("http://c:8000", [])
    assert "serves no worker package yet" in nothing[0][0] and nothing[0][1] == ""
