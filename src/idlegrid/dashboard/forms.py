"""A form that the browser's own checks did not stop (a script, an old browser, devtools)
and whose fields fail the server's: answered on the same form, with what was typed and
each error beside its field, never a bare error page.

Each form's page registers how to show itself again (`again`); `answer_invalid` is the
validation handler's first try for a POST to a dashboard path.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

# A form again: (request, what was typed, {field: error}, one line for the top) -> page.
Again = Callable[[Request, dict[str, str], dict[str, str], str], Awaitable[Response]]
_FORMS: list[tuple[re.Pattern[str], Again]] = []
# Never sent back into a page, whatever was typed.
_SECRET = {"csrf", "password", "current_password", "new_password"}


def again(path: str) -> Callable[[Again], Again]:
    """Register how the form posted to `path` (a regular expression) shows itself again."""

    def register(show: Again) -> Again:
        _FORMS.append((re.compile(path), show))
        return show

    return register


def field_errors(exc: RequestValidationError) -> dict[str, str]:
    """{form field: its error in words} of the body's fields."""
    out: dict[str, str] = {}
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        if len(loc) >= 2 and loc[0] == "body":
            message = str(err.get("msg", "is not valid"))
            if err.get("type") == "missing":
                message = "This field is required."
            out.setdefault(loc[1], message.rstrip(".") + ".")
    return out


def summary(errors: dict[str, str]) -> str:
    fields = ", ".join(name.replace("_", " ") for name in errors)
    return f"Check the field{'s' if len(errors) > 1 else ''} marked below: {fields}."


async def answer_invalid(request: Request, exc: RequestValidationError) -> Response | None:
    """The form again with its errors, or None when this POST is no registered form's."""
    if request.method != "POST":
        return None
    show = next((s for pattern, s in _FORMS if pattern.fullmatch(request.url.path)), None)
    errors = field_errors(exc)
    if show is None or not errors:
        return None
    form = await request.form()
    typed: dict[str, Any] = {
        k: v for k, v in form.items() if isinstance(v, str) and k not in _SECRET
    }
    return await show(request, typed, errors, summary(errors))
