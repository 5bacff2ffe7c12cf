"""Admin pages: accounts (roles, disable, flags), nodes (suspensions), queue, metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, Response

from idlegrid.dashboard.pages import (
    Admin,
    Csrf,
    Id,
    PageError,
    grid_of,
    page_bounds,
    redirect,
    render,
    store_of,
)
from idlegrid.store import accounts as store_accounts
from idlegrid.store import web

router = APIRouter(prefix="/admin")


@router.get("", response_class=HTMLResponse)
async def admin_page(
    request: Request,
    session: Admin,
    q: Annotated[str, Query(max_length=100)] = "",
    flagged: bool = False,
    page: Annotated[int, Query(ge=1, le=10_000)] = 1,
) -> Response:
    limit, offset = page_bounds(page, 50)
    store = store_of(request)
    accounts = await store.web.web_read(
        store_accounts.list_accounts,
        search=q.strip(),
        flagged=flagged,
        limit=limit + 1,
        offset=offset,
    )
    suspended = await store.web.web_read(web.list_all_nodes, suspended=True, limit=50, offset=0)
    recent = await store.web.web_read(web.list_all_nodes, suspended=False, limit=20, offset=0)
    return await render(
        request,
        "admin.html",
        accounts=accounts[:limit],
        has_next=len(accounts) > limit,
        page=page,
        q=q,
        flagged=flagged,
        suspended=suspended,
        recent_nodes=recent,
        queue=await grid_of(request).ready_count(),
        connected=grid_of(request).connected_here(),
    )


@router.post("/accounts/{account_id}/role", dependencies=[Csrf])
async def set_role(
    request: Request,
    account_id: Id,
    session: Admin,
    role: Annotated[Literal["volunteer", "researcher", "admin"], Form()],
) -> Response:
    if account_id == session.account.id and role != "admin":
        raise PageError(409, "You cannot take the admin role from yourself.")
    if not await store_of(request).web.web_write(store_accounts.set_role, account_id, role):
        raise PageError(404, f"There is no account {account_id}.")
    account = await store_of(request).web.web_read(store_accounts.web_account, account_id)
    name = account.name if account is not None else f"Account {account_id}"
    return redirect(request, "/admin", flash=f"{name} is now a {role}.")


@router.post("/accounts/{account_id}/disable", dependencies=[Csrf])
async def disable(
    request: Request,
    account_id: Id,
    session: Admin,
    disabled: Annotated[bool, Form()] = True,
) -> Response:
    if account_id == session.account.id:
        raise PageError(409, "You cannot disable your own account.")
    now = grid_of(request).clock()
    if not await store_of(request).web.web_write(
        store_accounts.set_disabled, account_id, disabled=disabled, now=now
    ):
        raise PageError(404, f"There is no account {account_id}.")
    what = "disabled; its sessions and tokens are revoked" if disabled else "enabled"
    return redirect(request, "/admin", flash=f"Account {account_id} is {what}.")


@router.post("/accounts/{account_id}/unflag", dependencies=[Csrf])
async def unflag(request: Request, account_id: Id, session: Admin) -> Response:
    if not await store_of(request).web.web_write(store_accounts.clear_flag, account_id):
        raise PageError(404, f"There is no account {account_id}.")
    return redirect(request, "/admin?flagged=true", flash=f"Account {account_id} is cleared.")


@router.post("/nodes/{node_id}/suspend", dependencies=[Csrf])
async def suspend(
    request: Request,
    node_id: Id,
    session: Admin,
    suspended: Annotated[bool, Form()] = True,
) -> Response:
    now = grid_of(request).clock()
    if not await store_of(request).web.web_write(
        web.set_suspended, node_id, suspended=suspended, now=now
    ):
        raise PageError(404, f"There is no node {node_id}.")
    what = "suspended" if suspended else "back on probation"
    return redirect(request, "/admin", flash=f"Node {node_id} is {what}.")


@router.get("/metrics", response_class=HTMLResponse)
async def metrics_page(request: Request, session: Admin) -> Response:
    """The Prometheus figures of this process, as a table a person reads."""
    text = await grid_of(request).metrics_text()
    return await render(request, "admin_metrics.html", families=parse_exposition(text))


def parse_exposition(text: str) -> list[tuple[str, str, list[tuple[str, float]]]]:
    """(name, help, [(labels, value)]) of each metric in Prometheus' text format."""
    families: list[tuple[str, str, list[tuple[str, float]]]] = []
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
            families.append((name, help_text, []))
        elif line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            if families and families[-1][0] == name:
                families[-1][2].append((labels.rstrip("}").replace('"', ""), float(value)))
    return families
