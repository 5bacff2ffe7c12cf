"""/docs in a real browser: the vendored Swagger UI reads the coordinator's OpenAPI 3.1
spec offline and lists every operation (Debian's Chromium driven by Playwright)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import chromium_page

from idlegrid.devtools.localgrid import LocalGrid

METHODS = {"get", "put", "post", "delete", "patch", "head", "options"}


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    with chromium_page() as opened:
        yield opened


@pytest.mark.slow
def test_docs_lists_every_operation_of_the_openapi_31_spec(page: Any, tmp_path: Path) -> None:
    with LocalGrid(tmp_path) as grid:
        spec = httpx.get(f"{grid.url}/openapi.json", timeout=10).json()
        assert spec["openapi"].startswith("3.1")
        operations = {
            (method.upper(), path)
            for path, item in spec["paths"].items()
            for method in item
            if method in METHODS
        }
        outside: list[str] = []
        page.on(
            "request",
            lambda request: (
                outside.append(request.url) if not request.url.startswith(grid.url) else None
            ),
        )
        page.goto(f"{grid.url}/docs")
        page.wait_for_selector(".opblock", timeout=30_000)
        shown = {
            (
                block.query_selector(".opblock-summary-method").inner_text().strip(),
                block.query_selector(".opblock-summary-path").get_attribute("data-path"),
            )
            for block in page.query_selector_all(".opblock")
        }
        assert "Unable to render" not in page.content()
        assert shown == operations
        assert outside == []  # nothing from a CDN: the page works offline
