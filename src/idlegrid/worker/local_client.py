"""Talk to the worker running on this machine through its local control page.

The CLI's subcommands, the tray and the app window all use it: the page's address and
token are in the state directory (`control.json`, `control-token`), which only the
worker's owner can read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from idlegrid.worker.control import ADDRESS_FILE, TOKEN_FILE


class LocalWorkerError(Exception):
    """No worker answers at this state directory, or it refused the request."""


class LocalWorker:
    """The control page of the worker whose state directory is `state_dir`."""

    def __init__(self, state_dir: Path, *, timeout: float = 10.0) -> None:
        self.state_dir = state_dir
        self.timeout = timeout

    def address(self) -> tuple[str, str]:
        """The page's URL and its token, as the running worker wrote them."""
        try:
            url = json.loads((self.state_dir / ADDRESS_FILE).read_text())["url"]
            token = (self.state_dir / TOKEN_FILE).read_text().strip()
        except (OSError, ValueError, KeyError):
            raise LocalWorkerError(
                f"no worker has run with state directory {self.state_dir}"
            ) from None
        return str(url), token

    def page_url(self) -> str:
        """The page's address with its token, for a browser or the app window."""
        url, token = self.address()
        return f"{url}?token={token}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url, token = self.address()
        try:
            response = httpx.request(
                method, url.rstrip("/") + path, json=body,
                headers={"Authorization": f"Bearer {token}"}, timeout=self.timeout,
            )  # fmt: skip
        except httpx.TransportError as exc:
            raise LocalWorkerError(f"the worker at {url} does not answer: {exc}") from None
        try:
            data = response.json()
        except ValueError:
            raise LocalWorkerError(f"the worker at {url} answered {response.status_code}") from None
        if response.status_code != 200:
            raise LocalWorkerError(str(data.get("error", response.text)))
        return data

    def status(self) -> dict[str, Any]:
        return dict(self.call("GET", "/api/status"))

    def act(self, action: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """`pause`, `resume`, `finish`, `snooze` (body `{"seconds": ...}`)."""
        return dict(self.call("POST", f"/api/{action}", body or {}))
