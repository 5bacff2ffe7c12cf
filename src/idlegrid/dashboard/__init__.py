"""The web dashboard: server-rendered pages of the coordinator's own app.

Jinja2 templates, HTMX for the live parts (polling), uPlot for charts; both scripts are
vendored under static/ with their licences, so the pages work with no internet and no
build step. Read-only pages render with JavaScript off.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from idlegrid.dashboard import (
    accounts,
    admin,
    downloads,
    model_training,
    node_controls,
    public,
    research,
    volunteer,
)
from idlegrid.dashboard.exports import Exporter
from idlegrid.dashboard.forms import answer_invalid
from idlegrid.dashboard.pages import (
    Dashboard,
    PageError,
    SignInRequired,
    dashboard_of,
    finish,
    make_dashboard,
)
from idlegrid.dashboard.shelf import Shelf
from idlegrid.dashboard.wheel_build import WheelBuilder
from idlegrid.settings import CoordinatorSettings

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
# Paths that answer JSON whatever the error: the API, the probes, the upload endpoints.
_JSON_PATHS = ("/v1/", "/healthz", "/metrics", "/research/uploads", "/static/")

__all__ = [
    "Exporter",
    "WheelBuilder",
    "answer_invalid",
    "error_page",
    "mount",
    "wants_html",
    "wheel_builder",
]


def mount(app: FastAPI, settings: CoordinatorSettings) -> None:
    """Add the dashboard's pages, static files and error pages to the coordinator app."""
    app.state.dashboard = make_dashboard(settings)
    modules = (public, accounts, volunteer, node_controls, research, model_training, admin,
               downloads)  # fmt: skip
    for module in modules:
        app.include_router(module.router, include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC, html=True), name="static")

    @app.exception_handler(PageError)
    async def on_page_error(request: Request, exc: PageError) -> Response:
        return await error_page(request, exc.status, exc.message, title=exc.title)

    @app.exception_handler(SignInRequired)
    async def on_sign_in(request: Request, exc: SignInRequired) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.headers.get("hx-request"):  # a live fragment: reload into sign-in
            return Response(status_code=401, headers={"HX-Redirect": "/signin"})
        response = RedirectResponse("/signin?" + _query({"next": target}), status_code=303)
        finish(request, response)
        return response


def wheel_builder(app: FastAPI) -> WheelBuilder:
    """What builds /download's wheel when it is missing (if `build_downloads` asks), for
    the app's lifespan to start and stop; /download reads how it went."""
    dash: Dashboard = app.state.dashboard
    builder = WheelBuilder(dash.settings.download_dir, enabled=dash.settings.build_downloads)
    dash.shelf = Shelf(dash.settings.download_dir, builder=builder)
    return builder


def _query(values: dict[str, str]) -> str:
    import urllib.parse

    return urllib.parse.urlencode(values)


def wants_html(request: Request) -> bool:
    """Whether an error on this request is shown as a page (not API JSON)."""
    return hasattr(request.app.state, "dashboard") and not request.url.path.startswith(_JSON_PATHS)


async def error_page(request: Request, status: int, message: str, *, title: str = "") -> Response:
    """An HTML error page; if even that fails (the store is down), plain HTML."""
    from idlegrid.dashboard.pages import render

    title = title or {404: "Not found", 403: "Not allowed", 422: "Not understood"}.get(
        status, "Something went wrong"
    )
    try:
        return await render(request, "error.html", status=status, title=title, message=message)
    except Exception:
        log.exception("rendering the error page failed")
        template = dashboard_of(request).templates.get_template("error_bare.html")
        body = template.render(title=title, message=message, status=status)
        return HTMLResponse(body, status_code=status)
