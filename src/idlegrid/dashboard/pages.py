"""What every dashboard page shares: templates, who is signed in, CSRF, errors, flashes."""

from __future__ import annotations

import datetime as dt
import json
import math
import urllib.parse
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from idlegrid import __version__
from idlegrid.coordinator.grid import Grid
from idlegrid.dashboard import security
from idlegrid.dashboard.shelf import Shelf
from idlegrid.protocol import MAX_ID
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.web import WebSession, find_session
from idlegrid.verification.credit import CreditTotals, recent_average

HERE = FilePath(__file__).parent
# An id in a page's path: past what the store holds it is a 422 page, not a 500.
Id = Annotated[int, Path(ge=1, le=MAX_ID)]
FLASH_COOKIE = "ig_flash"
# Scripts and styles only from this app: an injected <script> would not run.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'self'"
)


class PageError(Exception):
    """Shown as an HTML error page with this status."""

    def __init__(self, status: int, message: str, *, title: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.title = title or {403: "Not allowed", 404: "Not found"}.get(status, "Error")


class SignInRequired(Exception):
    """A page behind sign-in was asked for by a signed-out visitor."""


@dataclass
class Dashboard:
    """The dashboard's per-app state (`app.state.dashboard`)."""

    settings: CoordinatorSettings
    templates: Environment
    limiter: security.SignInLimiter
    # (when counted, accounts, teams) for the status page; see stats.grid_status.
    census: tuple[float, int, int] | None = None
    # The packages served at /download (downloads.shelf_of makes it on first use).
    shelf: Shelf | None = None


def make_dashboard(settings: CoordinatorSettings) -> Dashboard:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        credit=format_credit,
        number=lambda v: f"{v:,}",
        when=format_when,
        ago=format_ago,
        duration=format_duration,
        size=format_size,
        tojson_safe=lambda v: Markup(json.dumps(v).replace("<", "\\u003c")),
    )
    env.globals.update(version=__version__, rac=recent_average)
    limiter = security.SignInLimiter(
        per_account=settings.web_signin_failures_per_account,
        per_address=settings.web_signin_failures_per_address,
        window_s=settings.web_signin_window_s,
    )
    return Dashboard(settings=settings, templates=env, limiter=limiter)


def dashboard_of(request: Request) -> Dashboard:
    return request.app.state.dashboard  # type: ignore[no-any-return]


def grid_of(request: Request) -> Grid:
    return request.app.state.grid  # type: ignore[no-any-return]


def store_of(request: Request) -> Store:
    return grid_of(request).store


def address_of(request: Request) -> str:
    return request.client.host if request.client else "unknown"


# -- who is asking -----------------------------------------------------------------------


async def viewer(request: Request) -> WebSession | None:
    """The signed-in session of this request, or None (looked up once per request)."""
    if hasattr(request.state, "web_session"):
        return request.state.web_session  # type: ignore[no-any-return]
    found = None
    secret = request.cookies.get(security.SESSION_COOKIE)
    if secret:
        sid = security.session_id(secret)
        found = await store_of(request).web.web_read(
            find_session, sid, now=grid_of(request).clock()
        )
    request.state.web_session = found
    return found


async def signed_in(request: Request) -> WebSession:
    session = await viewer(request)
    if session is None:
        raise SignInRequired()
    return session


async def researcher(session: Annotated[WebSession, Depends(signed_in)]) -> WebSession:
    if not session.account.is_researcher:
        raise PageError(
            403,
            "Uploading data and submitting jobs is for researchers. An admin can give your "
            "account the researcher role.",
        )
    return session


async def admin(session: Annotated[WebSession, Depends(signed_in)]) -> WebSession:
    if not session.account.is_admin:
        raise PageError(404, "There is no such page.")
    return session


Viewer = Annotated[WebSession | None, Depends(viewer)]
SignedIn = Annotated[WebSession, Depends(signed_in)]
Researcher = Annotated[WebSession, Depends(researcher)]
Admin = Annotated[WebSession, Depends(admin)]


async def csrf_token(request: Request) -> str:
    """The token this visitor's forms carry: the session's, or the CSRF cookie's."""
    session = await viewer(request)
    if session is not None:
        return session.csrf
    token = request.cookies.get(security.CSRF_COOKIE) or getattr(request.state, "new_csrf", None)
    if not token:
        token = security.new_secret()
        request.state.new_csrf = token
    return token


async def check_csrf(request: Request) -> None:
    """Refuse a state-changing request whose form (or X-CSRF-Token header) lacks the token."""
    sent = request.headers.get("x-csrf-token")
    if sent is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        sent = (await request.form()).get("csrf")  # type: ignore[assignment]
    session = await viewer(request)
    expected = session.csrf if session else request.cookies.get(security.CSRF_COOKIE)
    if not security.same(sent, expected):
        raise PageError(
            403,
            "This form has expired or did not come from this site. Reload the page and try again.",
            title="Form expired",
        )


Csrf = Depends(check_csrf)


# -- responses ---------------------------------------------------------------------------


async def render(
    request: Request, template: str, *, status: int = 200, **context: Any
) -> HTMLResponse:
    dash = dashboard_of(request)
    session = await viewer(request)
    flash = request.cookies.get(FLASH_COOKIE)
    body = dash.templates.get_template(template).render(
        request=request,
        session=session,
        me=session.account if session else None,
        csrf=await csrf_token(request),
        flash=urllib.parse.unquote(flash) if flash else None,
        open_signup=dash.settings.web_open_signup,
        now=grid_of(request).clock(),
        **context,
    )
    response = HTMLResponse(body, status_code=status)
    finish(request, response)
    if flash:
        response.delete_cookie(FLASH_COOKIE, path="/")
    return response


def finish(request: Request, response: Response) -> None:
    """Security headers, and the CSRF cookie of a signed-out visitor's first form."""
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers.setdefault("Cache-Control", "no-store")
    new_csrf = getattr(request.state, "new_csrf", None)
    if new_csrf:
        set_cookie(request, response, security.CSRF_COOKIE, new_csrf, max_age=None)


def set_cookie(
    request: Request, response: Response, name: str, value: str, *, max_age: int | None
) -> None:
    secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
    response.set_cookie(
        name, value, max_age=max_age, path="/", httponly=True, samesite="lax", secure=secure
    )


def redirect(request: Request, url: str, *, flash: str | None = None) -> RedirectResponse:
    """303 See Other to `url` (after a POST), with a message for the next page."""
    response = RedirectResponse(url, status_code=303)
    if flash:
        set_cookie(request, response, FLASH_COOKIE, urllib.parse.quote(flash), max_age=60)
    finish(request, response)
    return response


def local_path(target: str | None, default: str = "/") -> str:
    """`target` if it is a path on this site (no open redirects), else `default`."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target


def page_bounds(page: int, per_page: int, *, max_rows: int = 100_000) -> tuple[int, int]:
    """Bounded pagination: a page number and a page size give a limit and an offset."""
    per_page = min(max(per_page, 1), 100)
    page = min(max(page, 1), max(1, max_rows // per_page))
    return per_page, (page - 1) * per_page


# -- formatting --------------------------------------------------------------------------


def format_credit(value: float | CreditTotals) -> str:
    amount = value.total if isinstance(value, CreditTotals) else value
    if amount >= 100:
        return f"{amount:,.0f}"
    if amount >= 1 or amount <= 0:
        return f"{amount:,.2f}"
    return f"{amount:.3g}"  # a few short tasks: still visibly more than nothing


def format_when(epoch: float | None) -> str:
    if not epoch:
        return "never"
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def format_ago(epoch: float | None, now: float | None = None) -> str:
    if not epoch:
        return "never"
    seconds = max(0.0, (now or dt.datetime.now(dt.UTC).timestamp()) - epoch)
    return "just now" if seconds < 5 else format_duration(seconds) + " ago"


def format_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    for unit, size in (("d", 86_400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            whole = math.floor(seconds / size)
            rest = seconds - whole * size
            if unit == "d" and rest >= 3600:
                return f"{whole} d {math.floor(rest / 3600)} h"
            if unit == "h" and rest >= 60:
                return f"{whole} h {math.floor(rest / 60)} min"
            return f"{whole} {unit}"
    return f"{seconds:.0f} s"


def format_size(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "bytes" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:,.1f} GiB"
