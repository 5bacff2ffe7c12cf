"""The dashboard's chart ticks in a real browser: as many decimals as their step needs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import chromium_page

from idlegrid import dashboard

SCRIPT = Path(dashboard.__file__).parent / "static" / "dashboard.js"


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    """One browser for the table: the dashboard's script loaded into a blank page."""
    with chromium_page(locale="en-US") as opened:
        opened.set_content(f"<html><body><script>{SCRIPT.read_text()}</script></body></html>")
        yield opened


@pytest.mark.parametrize(
    ("splits", "step", "labels"),
    [
        ([0.001, 0.0012, 0.0014, 0.0016], 0.0002, ["0.0010", "0.0012", "0.0014", "0.0016"]),
        ([0, 0.5, 1, 1.5], 0.5, ["0.0", "0.5", "1.0", "1.5"]),
        ([0, 2000, 4000], 2000, ["0", "2,000", "4,000"]),
        ([0.0, 0.25, 0.5], 0.25, ["0.00", "0.25", "0.50"]),
    ],
)
def test_tick_labels_never_repeat(
    page: Any, splits: list[float], step: float, labels: list[str]
) -> None:
    shown = page.evaluate(
        "([splits, step]) => window.idlegridCharts.tickLabels(null, splits, 1, 50, step)",
        [splits, step],
    )
    assert shown == labels
    assert len(set(shown)) == len(shown)
