"""The coordinator ASGI application: REST API, node WebSocket, background loops."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idlegrid import __version__, dashboard
from idlegrid.blobs.files import BlobStore, blob_too_large
from idlegrid.broker import open_broker
from idlegrid.coordinator import api, metrics
from idlegrid.coordinator.auth import display_prefix, hash_token, new_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.guard import Guard
from idlegrid.coordinator.monitor import Monitor
from idlegrid.coordinator.node_socket import node_socket
from idlegrid.coordinator.swarm import Swarm
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store, open_store
from idlegrid.store.base import AccountExists
from idlegrid.units import size_text

log = logging.getLogger(__name__)


def create_app(settings: CoordinatorSettings, *, owns_process: bool = False) -> FastAPI:
    """The coordinator for `settings`; state opens in the lifespan, not at import.

    `owns_process`: the app is the process's only tenant (`idlegrid serve`), so it may
    tune process-wide state: the garbage collector (`settings.gc_freeze_s`).
    """
    app = FastAPI(
        title="idlegrid coordinator",
        version=__version__,
        lifespan=_lifespan(settings, owns_process=owns_process),
        description="Jobs, blobs and results for researchers; a WebSocket for worker nodes.",
        # Both default pages load their scripts from a CDN: /docs is served offline below.
        docs_url=None,
        redoc_url=None,
    )
    app.state.guard = Guard.from_settings(settings)
    app.include_router(api.router)
    _install_api_docs(app)
    _tidy_openapi(app)
    dashboard.mount(app, settings)
    _install_error_handlers(app)
    app.add_middleware(
        BodyLimit, default_limit=settings.max_request_bytes, blob_limit=settings.max_blob_bytes
    )
    _install_meta_routes(app)
    return app


def _lifespan(
    settings: CoordinatorSettings, *, owns_process: bool
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Opens the store, broker and blobs, starts the monitor and the dashboard's exporter;
    on shutdown stops them, closes every node session and commits what is queued."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = open_store(settings.database, schema=settings.database_schema, trust=settings.trust)
        await store.open()
        await bootstrap_admin(store, settings)
        broker = open_broker(settings.redis_url, prefix=settings.redis_prefix)
        grid = Grid(
            settings=settings,
            store=store,
            broker=broker,
            blobs=BlobStore(settings.blob_dir, max_bytes=settings.max_blob_bytes),
        )
        swarm = Swarm(settings)  # peer-to-peer rounds' bootstrap DHT peer, if any
        swarm.start_soon(grid.set_swarm_peers)
        monitor = Monitor(grid, tune_gc=owns_process)
        await monitor.start()
        exporter = dashboard.Exporter(
            store, settings.data_dir, interval_s=settings.web_export_interval_s
        )
        await exporter.start()
        builder = dashboard.wheel_builder(app)  # /download's wheel, if missing and buildable
        await builder.start()
        app.state.grid = grid
        try:
            yield
        finally:
            await builder.stop()
            await exporter.stop()
            await monitor.stop()
            await swarm.stop()
            await grid.close_connections()
            await grid.aclose()  # results already queued are committed before the store closes
            await broker.close()
            await store.close()

    return lifespan


def _install_meta_routes(app: FastAPI) -> None:
    """/healthz, /metrics and the nodes' WebSocket."""

    @app.get("/healthz", tags=["meta"])
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    @app.get(
        "/metrics",
        tags=["meta"],
        response_class=Response,
        responses=api.error_responses(401, 403, 429),
    )
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus metrics of this coordinator process (text exposition format).

        For the addresses in the `metrics_allow` setting, and for admin tokens."""
        await api.metrics_reader(request)
        grid: Grid = request.app.state.grid
        text = await grid.metrics_text()
        return Response(text, media_type=metrics.CONTENT_TYPE)

    @app.websocket("/v1/nodes/ws")
    async def nodes_ws(websocket: WebSocket) -> None:
        await node_socket(websocket, websocket.app.state.grid, websocket.app.state.guard)


DOCS_ASSETS = "/docs/assets"
# scripts/vendor-swagger-ui.sh refreshes it from npm's swagger-ui-dist.
SWAGGER_UI = Path(__file__).parent / "coordinator" / "api" / "swagger_ui"


def _install_api_docs(app: FastAPI) -> None:
    """Swagger UI at /docs from assets vendored in the package (npm's swagger-ui-dist, which
    reads OpenAPI 3.1): no CDN, so the reference works on a coordinator with no internet."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=str(SWAGGER_UI)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def api_docs() -> Response:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API reference",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


def _allowed_methods(app: FastAPI, request: Request) -> str | None:
    """Every method some route takes at this path (Starlette names only the first's)."""
    path = request.url.path
    methods: set[str] = set()
    for route in [*app.router.routes, *api.router.routes]:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods)
    return ", ".join(sorted(methods)) or None


def _tidy_openapi(app: FastAPI) -> None:
    """The spec as the API behaves: an optional header or query parameter is one that may
    be left out (`required: false`), not one that may be sent as the text "null"."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = make()
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    for parameter in operation.get("parameters", []):
                        parameter["schema"] = _without_null(parameter.get("schema", {}))
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    options = schema.get("anyOf")
    if not options:
        return schema
    kept = [option for option in options if option.get("type") != "null"]
    if len(kept) != 1:
        return schema
    tidy = {key: value for key, value in schema.items() if key != "anyOf"}
    return {**kept[0], **tidy}


async def bootstrap_admin(store: Store, settings: CoordinatorSettings) -> None:
    """On the first start, make an admin account and write its token to a 0600 file."""
    if await store.accounts.count_accounts() > 0:
        return
    import time

    try:
        account = await store.accounts.create_account("admin", is_admin=True, now=time.time())
    except AccountExists:
        return  # another coordinator process sharing the database made it a moment ago
    token = new_token("api")
    await store.accounts.add_token(
        account.id,
        kind="api",
        token_hash=hash_token(token),
        prefix=display_prefix(token),
        label="bootstrap",
        now=time.time(),
    )
    path = settings.admin_token_file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    log.warning(
        "created the admin account; its API token is in %s (read it with: cat %s)", path, path
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.ApiError)
    async def on_api_error(request: Request, exc: api.ApiError) -> Any:
        return api.error_response(exc.status, exc.code, exc.message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Any:
        parts = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg')}")
        if dashboard.wants_html(request):
            page = await dashboard.answer_invalid(request, exc)
            return page or await dashboard.error_page(request, 422, "; ".join(parts))
        return api.error_response(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Any:
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status_code, "http_error"
        )
        if dashboard.wants_html(request):
            page = await dashboard.error_page(request, exc.status_code, str(exc.detail))
            page.headers.update(exc.headers or {})
            return page
        response = api.error_response(exc.status_code, code, str(exc.detail))
        response.headers.update(exc.headers or {})
        allowed = _allowed_methods(app, request) if exc.status_code == 405 else None
        if allowed:
            response.headers["Allow"] = allowed
        return response

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect) -> Any:
        # An upload cut short is the client's business: one line, no traceback.
        log.info("%s %s ended: the client went away", request.method, request.url.path)
        return api.error_response(400, "client_disconnected", "the client went away")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Any:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        if dashboard.wants_html(request):
            message = "The page could not be made; the coordinator logged why. Try again soon."
            return await dashboard.error_page(request, 500, message)
        return api.error_response(500, "internal", "internal error; the coordinator logged it")


class BodyLimit:
    """Refuse request bodies over the limit with 413, even without a Content-Length."""

    def __init__(self, app: ASGIApp, *, default_limit: int, blob_limit: int) -> None:
        self.app = app
        self.default_limit = default_limit
        self.blob_limit = blob_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        limit = self.blob_limit if path.startswith("/v1/blobs/") else self.default_limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_413(send, _body_too_large(limit, int(declared), path=path))
            return
        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge(_body_too_large(limit, None, path=path))
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge as exc:
            if not response_started:
                await _send_413(send, str(exc.detail))


def _body_too_large(limit: int, size: int | None, *, path: str) -> str:
    """Why a body is refused for its size, with the way around and the setting."""
    if path.startswith("/v1/blobs/"):
        return blob_too_large(size, limit)
    if path.startswith("/v1/uploads/"):
        return (
            f"a chunk is over the {size_text(limit)} limit of one request: send chunks of at "
            f"most {limit} bytes (the chunk_size that POST /v1/uploads answers)"
        )
    what = f"request body of {size_text(size)}" if size else "request body"
    raise_to = f" to at least {size} (IDLEGRID_MAX_REQUEST_BYTES={size})" if size else ""
    return (
        f"{what} is over the {size_text(limit)} limit of one request (max_request_bytes "
        f"{limit}): send large data as blobs (PUT /v1/blobs/SHA256, or in chunks: POST "
        f"/v1/uploads) and name them, or ask the operator to raise max_request_bytes{raise_to}"
    )


class _TooLarge(StarletteHTTPException):
    # An HTTPException, because FastAPI turns any other error raised while it reads a
    # JSON body into "400 There was an error parsing the body".
    def __init__(self, message: str) -> None:
        super().__init__(413, message)


async def _send_413(send: Send, message: str) -> None:
    response = api.error_response(413, "too_large", message)
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(response.body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": response.body})
