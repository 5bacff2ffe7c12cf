"""The coordinator serves its own worker: `/download` lists the packages built into its
data directory (its wheel by `idlegrid serve` at start, `wheel_build.py`; any of them by
`scripts/build-downloads.sh`), each with its SHA-256, and the commands that install a
worker against this coordinator with the node token in a private file.

Only admins see where the data directory is and what the build said; anyone else is
told whether a package is coming, never a server path.
"""

from __future__ import annotations

import shlex

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response

from idlegrid.dashboard.pages import PageError, Viewer, dashboard_of, finish, render
from idlegrid.dashboard.shelf import BINARY, Package, Shelf, wanted
from idlegrid.dashboard.wheel_build import BuildState
from idlegrid.store.web import WebSession

router = APIRouter()
# Where the volunteer's worker keeps its node token; only its owner may read the file.
TOKEN_FILE = "~/.idlegrid/node-token"
BUILD = "scripts/build-downloads.sh --data-dir {data_dir}"


def shelf_of(request: Request) -> Shelf:
    dash = dashboard_of(request)
    if dash.shelf is None:
        dash.shelf = Shelf(dash.settings.download_dir)
    return dash.shelf


def server_of(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def node_commands(server: str, packages: list[Package], *, name: str = "") -> list[tuple[str, str]]:
    """What a volunteer types on the new machine (POSIX shells: sh, bash, zsh), from
    installing the worker to starting it, the token kept in a file only they can read."""
    wheel = next((p for p in packages if p.is_wheel), None)
    binary = next((p for p in packages if BINARY.fullmatch(p.name) and "linux" in p.name), None)
    start = f"--server {shlex.quote(server)} --token-file {TOKEN_FILE}"
    if name:
        start += f" --name {shlex.quote(name)}"
    steps = []
    if wheel is not None or binary is None:
        steps.append(install_wheel(server, wheel))
        program = "idlegrid worker"
    else:
        steps.append(install_binary(server, binary))
        program = "./idlegrid-worker"
    steps.append(
        (
            "Save the node token in a file only you can read (paste the token, then press Enter)",
            f"(umask 077 && mkdir -p ~/.idlegrid && head -n 1 > {TOKEN_FILE})",
        )
    )
    steps.append(("Start the worker", f"{program} {start}"))
    return steps


def install_wheel(server: str, wheel: Package | None) -> tuple[str, str]:
    """pip's command for this coordinator's wheel (pip checks the hash in the URL); with
    none served yet, no command: a step that says so (the step's command is empty)."""
    if wheel is None:
        return (
            "This coordinator serves no worker package yet: its operator builds one (the "
            "coordinator builds its wheel at start where it can). Reload this page once "
            "/download lists it.",
            "",
        )
    url = f"{server}/download/{wheel.name}#sha256={wheel.sha256}"
    return (
        "Install the worker (Python 3.11 or newer)",
        f"python3 -m pip install {shlex.quote(f'idlegrid[worker] @ {url}')}",
    )


def install_binary(server: str, binary: Package) -> tuple[str, str]:
    """curl's command for a one-file worker, checked against its SHA-256."""
    url = f"{server}/download/{binary.name}"
    return (
        "Or download the one-file worker and check its SHA-256",
        f"curl -fLo idlegrid-worker {shlex.quote(url)} && "
        f'echo "{binary.sha256}  idlegrid-worker" | sha256sum -c && '
        "chmod +x idlegrid-worker",
    )


def build_note(shelf: Shelf, session: WebSession | None, data_dir: object) -> tuple[str, str]:
    """(what anyone is told, what only an admin is told) about packages not served yet."""
    builder = shelf.builder
    if builder is not None and builder.state is BuildState.BUILDING:
        return "The worker package is being built (seconds): reload this page.", ""
    public = (
        "No worker package is served here yet: its operator builds one, and this page "
        "lists it then."
    )
    if session is None or not session.account.is_admin:
        return public, ""
    why = f" ({builder.reason})" if builder is not None and builder.reason else ""
    return public, f"Build them with: {BUILD.format(data_dir=data_dir)}{why}"


@router.get("/download", response_class=HTMLResponse)
async def download_page(request: Request, session: Viewer) -> Response:
    shelf = shelf_of(request)
    packages = await shelf.packages()
    note, admin_note = build_note(shelf, session, dashboard_of(request).settings.data_dir)
    return await render(
        request,
        "download.html",
        packages=packages,
        commands=node_commands(server_of(request), packages),
        binaries=[
            install_binary(server_of(request), p)
            for p in packages
            if not p.is_wheel and not p.name.endswith(".tar.gz")
        ],
        note=note,
        admin_note=admin_note,
    )


@router.get("/download/SHA256SUMS", response_class=PlainTextResponse)
async def checksums(request: Request) -> Response:
    """The packages' hashes in the format `sha256sum -c` reads."""
    lines = [f"{p.sha256}  {p.name}\n" for p in await shelf_of(request).packages()]
    response = PlainTextResponse("".join(lines))
    finish(request, response)
    return response


@router.get("/download/{name}")
async def download(request: Request, name: str) -> Response:
    shelf = shelf_of(request)
    package = await shelf.find(name)
    if package is None:
        if not wanted(name):
            raise PageError(404, f"{name} is not a package this coordinator serves: "
                            "/download lists those it does.", title="Not found")  # fmt: skip
        builder = shelf.builder
        if builder is not None and builder.state is BuildState.BUILDING:
            raise PageError(404, f"{name} is being built: try again in a few seconds.",
                            title="Being built")  # fmt: skip
        raise PageError(
            404,
            f"{name} is not built on this coordinator yet: its operator builds it, and "
            "/download lists it then.",
            title="Not built",
        )
    response = FileResponse(
        shelf.directory / package.name,
        media_type="application/octet-stream",
        filename=package.name,
        headers={"Cache-Control": "no-cache", "X-Checksum-Sha256": package.sha256},
    )
    return response
