"""What the tray shows for a worker status: pure, so a table tests it; and its icon.

The icon is a disc in the state's colour, drawn with Pillow (no image files to ship):
green while computing, amber while throttled, grey while paused, red when the worker does
not answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

COLOURS = {
    "running": (46, 160, 67),
    "throttled": (214, 158, 46),
    "paused": (130, 130, 130),
    "unreachable": (200, 50, 50),
}
_MAX_TITLE = 120  # tooltips are cut by the desktop anyway; keep them one line


@dataclass(frozen=True)
class TrayView:
    state: str  # a key of COLOURS
    title: str  # the tooltip, and the menu's first (disabled) line
    can_pause: bool
    can_resume: bool


def view_of(status: dict[str, Any] | None, problem: str = "") -> TrayView:
    """The tray's view of `GET /api/status`, or of a worker that does not answer."""
    if status is None:
        return TrayView("unreachable", f"idlegrid: {problem or 'no worker answers'}"[:_MAX_TITLE],
                        can_pause=False, can_resume=False)  # fmt: skip
    state = status.get("state", "paused")
    state = state if state in COLOURS else "paused"
    reason = str(status.get("reason") or state)
    headline = (
        reason if reason.startswith(("running", "paused", "finishing")) else (f"{state}: {reason}")
    )
    owner_paused = bool(status.get("controls", {}).get("paused")) or bool(
        status.get("controls", {}).get("snooze_until")
    )
    return TrayView(
        state,
        f"idlegrid: {headline}"[:_MAX_TITLE],
        can_pause=not owner_paused,
        can_resume=owner_paused or state == "paused",
    )


def icon_image(state: str, size: int = 64) -> Image.Image:
    """The tray icon for `state`: a disc in its colour on a transparent square."""
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    margin = size // 16
    draw.ellipse(
        (margin, margin, size - margin - 1, size - margin - 1),
        fill=(*COLOURS.get(state, COLOURS["paused"]), 255),
        outline=(255, 255, 255, 255),
        width=max(1, size // 16),
    )
    return image
