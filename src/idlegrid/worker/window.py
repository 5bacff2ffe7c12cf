"""`idlegrid app`: the worker's local control page in a native window (pywebview).

pywebview shows the page in the platform's own web view: WebKitGTK (or Qt WebEngine) on
Linux, WKWebView on macOS, WebView2 on Windows; the page is the same one a browser shows
at 127.0.0.1:7390, so the window has every control the page has.
"""

from __future__ import annotations

from pathlib import Path

import click

from idlegrid.worker.local_client import LocalWorker, LocalWorkerError

TITLE = "idlegrid worker"


def open_window(state_dir: Path, *, width: int = 900, height: int = 720) -> None:
    """Open the window and wait until it is closed."""
    try:
        url = LocalWorker(state_dir).page_url()
    except LocalWorkerError as exc:
        raise click.ClickException(f"{exc} (start it first: idlegrid worker)") from None
    import webview

    webview.create_window(TITLE, url, width=width, height=height, min_size=(420, 360))
    webview.start()
