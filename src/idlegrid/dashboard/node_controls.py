"""A volunteer's nodes controlled from the web: pause, resume, finish, snooze, settings.

Every change goes through the coordinator (`Grid.change_node_settings`), which checks
it, stores it with who and when, and sends it over the node's WebSocket (or after its
next welcome). Only the node's owner, or an admin, may change a node; anyone else gets
the same 404 as for a node that does not exist.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Path, Request
from fastapi.responses import HTMLResponse, Response

from idlegrid.coordinator.grid import NodeNotFound, SettingRefused
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    SignedIn,
    grid_of,
    redirect,
    render,
    store_of,
)
from idlegrid.store.base import NodeRecord
from idlegrid.store.web import WebSession

router = APIRouter()

ACTIONS = {
    "run": "resumed",
    "pause": "paused",
    "finish": "finishing, then pausing",
    "snooze": "snoozed",
}
MAX_SNOOZE_H = 7 * 24.0
# The settings form: each field, how the page reads it, and how it is labelled.
FIELDS: dict[str, tuple[str, str]] = {
    "cpu_mode": ("mode", "CPU"),
    "gpu_mode": ("mode", "GPU"),
    "cpu_percent": ("float", "CPU % while idle"),
    "in_use_cpu_percent": ("float", "CPU % while in use"),
    "cpu_cores": ("int", "CPU cores (0: all)"),
    "memory_percent": ("float", "Memory cap (% of RAM)"),
    "windows": ("text", "Time windows"),
    "exclusive_apps": ("list", "Exclusive programs"),
    "daily_download_mb": ("float", "Daily download cap (MB, 0: none)"),
    "paused_gpus": ("indices", "Paused GPUs (their indices, e.g. 0, 2)"),
}


async def owned(request: Request, session: WebSession, node_id: int) -> NodeRecord:
    """The node, if the signed-in account owns it or is an admin; a 404 page otherwise."""
    try:
        return await grid_of(request).node_for(
            node_id, account_id=session.account.id, admin=session.account.is_admin
        )
    except NodeNotFound:
        raise PageError(404, f"There is no node {node_id} of yours.") from None


def control_value(action: str, hours: float, *, now: float) -> dict[str, Any]:
    """The `control` setting for a button on the page."""
    if action not in ACTIONS:
        raise PageError(422, f"There is no action {action!r}.")
    if action != "snooze":
        return {"action": action}
    if not 0 < hours <= MAX_SNOOZE_H:
        raise PageError(422, f"A snooze lasts more than 0 and at most {MAX_SNOOZE_H:g} hours.")
    return {"action": "snooze", "until": now + hours * 3600.0}


def who(session: WebSession) -> str:
    return f"{session.account.name} (admin)" if session.account.is_admin else session.account.name


@router.post("/my/nodes/{node_id}/control", dependencies=[Csrf])
async def control_node(
    request: Request,
    node_id: Id,
    session: SignedIn,
    action: Annotated[str, Form(max_length=10)],
    hours: Annotated[float, Form(ge=0, le=MAX_SNOOZE_H)] = 1.0,
) -> Response:
    node = await owned(request, session, node_id)
    grid = grid_of(request)
    value = control_value(action, hours, now=grid.clock())
    await grid.change_node_settings(node, {"control": value}, by=who(session))
    name = node.name or f"node {node.id}"
    return redirect(request, "/my/nodes", flash=f"{name}: {ACTIONS[action]}.")


@router.post("/my/nodes/control", dependencies=[Csrf])
async def control_all(
    request: Request,
    session: SignedIn,
    action: Annotated[str, Form(max_length=10)],
    hours: Annotated[float, Form(ge=0, le=MAX_SNOOZE_H)] = 1.0,
) -> Response:
    """The same action for every node of the account."""
    grid = grid_of(request)
    value = control_value(action, hours, now=grid.clock())
    nodes = await grid.store.nodes.list_nodes(session.account.id)
    for node in nodes:
        await grid.change_node_settings(node, {"control": value}, by=who(session))
    return redirect(request, "/my/nodes", flash=f"All {len(nodes)} nodes: {ACTIONS[action]}.")


@router.post("/my/nodes/{node_id}/gpus/{gpu}", dependencies=[Csrf])
async def control_gpu(
    request: Request,
    node_id: Id,
    gpu: Annotated[int, Path(ge=0, le=10_000)],
    session: SignedIn,
    action: Annotated[str, Form(max_length=10)],
) -> Response:
    """Pause one GPU of a node, or let it run again; the node's other devices go on."""
    node = await owned(request, session, node_id)
    if action not in ("pause", "run"):
        raise PageError(422, f"There is no GPU action {action!r} (pause or run).")
    stored = (await _stored(request, node.id)).get("paused_gpus")
    paused = {int(i) for i in (stored.value if stored else None) or []}
    paused = paused | {gpu} if action == "pause" else paused - {gpu}
    try:
        await grid_of(request).change_node_settings(
            node, {"paused_gpus": sorted(paused)}, by=who(session)
        )
    except SettingRefused as exc:
        raise PageError(422, f"{exc}. The node keeps its settings.") from None
    name = node.name or f"node {node.id}"
    word = "paused" if action == "pause" else "running again"
    return redirect(request, "/my/nodes", flash=f"{name}: GPU {gpu} {word}.")


@router.get("/my/nodes/{node_id}/settings", response_class=HTMLResponse)
async def settings_page(request: Request, node_id: Id, session: SignedIn) -> Response:
    node = await owned(request, session, node_id)
    return await _render_settings(request, node, error=None, sent=None)


@router.post("/my/nodes/{node_id}/settings", response_class=HTMLResponse, dependencies=[Csrf])
async def change_settings(request: Request, node_id: Id, session: SignedIn) -> Response:
    """Store what the form changed; a value the node cannot use changes nothing (422)."""
    node = await owned(request, session, node_id)
    form = await request.form()
    sent = {name: str(form.get(name, "")) for name in FIELDS}
    stored = await _stored(request, node.id)
    try:
        changes = changed_values(sent, {name: row.value for name, row in stored.items()})
        written = await grid_of(request).change_node_settings(node, changes, by=who(session))
    except SettingRefused as exc:
        return await _render_settings(request, node, error=str(exc), sent=sent, status=422)
    what = ", ".join(written) if written else "nothing changed"
    return redirect(request, f"/my/nodes/{node.id}/settings", flash=f"Saved: {what}.")


def changed_values(sent: dict[str, str], current: dict[str, Any]) -> dict[str, Any]:
    """The form's values that differ from the node's (a field left empty keeps its value)."""
    out: dict[str, Any] = {}
    for name, raw in sent.items():
        how = FIELDS[name][0]
        text = raw.strip()
        if not text and (how not in ("text", "list", "indices") or not current.get(name)):
            continue
        value = _read(name, how, text)
        if value != current.get(name):
            out[name] = value
    return out


def _read(name: str, how: str, text: str) -> Any:
    if how == "list":
        return [part.strip() for part in text.split(",") if part.strip()]
    if how == "indices":
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not all(part.isdigit() for part in parts):
            raise SettingRefused(f"{name}: {text!r} is not a list of GPU indices")
        return sorted({int(part) for part in parts})
    if how in ("int", "float"):
        try:
            number = float(text)
        except ValueError:
            raise SettingRefused(f"{name}: {text!r} is not a number") from None
        if how == "int":
            if not number.is_integer():
                raise SettingRefused(f"{name}: {text!r} is not a whole number")
            return int(number)
        return number
    return text


async def _stored(request: Request, node_id: int) -> dict[str, Any]:
    store = store_of(request)
    return (await store.node_control.settings_of([node_id]))[node_id]


async def _render_settings(
    request: Request,
    node: NodeRecord,
    *,
    error: str | None,
    sent: dict[str, str] | None,
    status: int = 200,
) -> HTMLResponse:
    store = store_of(request)
    stored = await _stored(request, node.id)
    activity = (await store.node_control.activity_of([node.id])).get(node.id)
    values = sent or {name: _shown(stored[name].value) for name in FIELDS if name in stored}
    return await render(
        request,
        "node_settings.html",
        status=status,
        node=node,
        fields=FIELDS,
        values=values,
        stored=stored,
        activity=activity,
        error=error,
    )


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "" if value is None else str(value)
