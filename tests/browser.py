"""Debian's Chromium driven by Playwright, for tests of pages: never a downloaded browser.

Without Chromium or playwright the tests that use it skip, except under CI=true, where
they fail (apt-get install chromium; pip install playwright).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = os.environ.get("IDLEGRID_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def missing(reason: str) -> None:
    """Skip for a missing browser, or fail under CI=true."""
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{reason}; CI=true requires it (apt-get install chromium)")
    pytest.skip(f"{reason}: apt-get install chromium, pip install playwright")


@contextlib.contextmanager
def chromium_page(**context: Any) -> Iterator[Any]:
    """A fresh page of a headless Chromium, closed after."""
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser.new_context(**context).new_page()
        finally:
            browser.close()
