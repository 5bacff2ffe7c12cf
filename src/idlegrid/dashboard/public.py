"""Pages anyone may read: project status, leaderboards, teams, profiles, exports."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from idlegrid.dashboard import exports, forms
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    SignedIn,
    Viewer,
    dashboard_of,
    grid_of,
    page_bounds,
    redirect,
    render,
    store_of,
)
from idlegrid.store import accounts as store_accounts
from idlegrid.store import stats, web

router = APIRouter()
DAY_S = 86_400
TEAM_NAME = re.compile(r"\S(.{0,98}\S)?")
BOARD_TITLES = {"accounts": "Volunteers", "teams": "Teams", "nodes": "Nodes"}
PageNumber = Annotated[int, Query(ge=1, le=100_000)]
# Leaderboards page through the top ranks only: each page skips its offset in the credit
# index, so the deepest page bounds a page's cost. Everyone's own rank is on their
# profile, and the daily exports list everyone.
LEADERBOARD_ROWS = 10_000
# How long the status page reuses its count of accounts and teams (seconds).
CENSUS_TTL_S = 60.0
PerPage = Annotated[int, Query(ge=1, le=100)]


@router.get("/", response_class=HTMLResponse)
async def status_page(request: Request) -> Response:
    now = grid_of(request).clock()
    dash = dashboard_of(request)
    fresh = dash.census is not None and now - dash.census[0] < CENSUS_TTL_S
    census = dash.census[1:] if fresh and dash.census else None
    status = await store_of(request).web.web_read(stats.grid_status, now=now, census=census)
    if census is None:
        dash.census = (now, status.accounts, status.teams)
    flops_24h = status.flops_since(now - DAY_S)
    top = await store_of(request).web.web_read(
        stats.leaderboard, "accounts", order="recent", limit=5, offset=0
    )
    unit, scale = flops_unit(max([flops_24h / DAY_S, *(p.flops / 3600 for p in status.hourly)]))
    return await render(
        request,
        "status.html",
        fleet=status,
        compute_24h=flops_24h / DAY_S / scale,
        unit=unit,
        scale=scale,
        validated_24h=status.validated_since(now - DAY_S),
        top=top,
        charts=status_charts(status, now=now, scale=scale),
    )


FLOPS_UNITS = (("PFLOPS", 1e15), ("TFLOPS", 1e12), ("GFLOPS", 1e9), ("MFLOPS", 1e6))


def flops_unit(largest: float) -> tuple[str, float]:
    """The unit in which `largest` (FLOP/s) reads as at least 1 (MFLOPS at the least)."""
    for unit, scale in FLOPS_UNITS:
        if largest >= scale:
            return unit, scale
    return FLOPS_UNITS[-1]


def status_charts(status: stats.GridStatus, *, now: float, scale: float) -> dict[str, Any]:
    """The status page's series; each x axis spans its whole period, not only its data."""
    return {
        "daily": {
            "range": [now - 30 * DAY_S, now + DAY_S],
            "x": [p.start for p in status.daily],
            "validated": [p.validated for p in status.daily],
        },
        "hourly": {
            "range": [now - 2 * DAY_S, now + 3600],
            "x": [p.start for p in status.hourly],
            "rate": [round(p.flops / 3600 / scale, 6) for p in status.hourly],
        },
    }


@router.get("/leaderboard/{board}", response_class=HTMLResponse)
async def leaderboard(
    request: Request,
    board: Literal["accounts", "teams", "nodes"],
    sort: Literal["total", "recent"] = "total",
    page: PageNumber = 1,
    per_page: PerPage = 50,
) -> Response:
    limit, offset = page_bounds(page, per_page, max_rows=LEADERBOARD_ROWS)
    rows = await store_of(request).web.web_read(
        stats.leaderboard, board, order=sort, limit=limit + 1, offset=offset
    )
    more = len(rows) > limit
    return await render(
        request,
        "leaderboard.html",
        board=board,
        title=BOARD_TITLES[board],
        sort=sort,
        rows=rows[:limit],
        page=offset // limit + 1,
        per_page=limit,
        has_next=more and offset + limit < LEADERBOARD_ROWS,
        at_end=more and offset + limit >= LEADERBOARD_ROWS,
        max_rows=LEADERBOARD_ROWS,
    )


@router.get("/users/{account_id}", response_class=HTMLResponse)
async def profile(request: Request, account_id: Id) -> Response:
    store = store_of(request)
    account = await store.web.web_read(store_accounts.web_account, account_id)
    if account is None:
        raise PageError(404, "There is no such volunteer.")
    standing = await store.web.web_read(stats.standing, "accounts", account.id)
    nodes = await grid_of(request).store.nodes.list_nodes(account.id)
    return await render(request, "profile.html", account=account, standing=standing, nodes=nodes)


# -- teams ---------------------------------------------------------------------------------


@router.get("/teams", response_class=HTMLResponse)
async def teams_page(
    request: Request, q: Annotated[str, Query(max_length=100)] = "", page: PageNumber = 1
) -> Response:
    limit, offset = page_bounds(page, 50, max_rows=LEADERBOARD_ROWS)
    store = store_of(request)
    found = await store.web.web_read(web.search_teams, q.strip(), limit=50) if q.strip() else None
    rows = await store.web.web_read(
        stats.leaderboard, "teams", order="total", limit=limit + 1, offset=offset
    )
    return await render(
        request,
        "teams.html",
        q=q,
        found=found,
        rows=rows[:limit],
        page=offset // limit + 1,
        has_next=len(rows) > limit and offset + limit < LEADERBOARD_ROWS,
    )


@router.get("/teams/new", response_class=HTMLResponse)
async def new_team_page(request: Request, session: SignedIn) -> Response:
    return await render(request, "team_new.html", values={}, error=None)


@router.post("/teams/new", response_class=HTMLResponse, dependencies=[Csrf])
async def create_team(
    request: Request,
    session: SignedIn,
    name: Annotated[str, Form(max_length=200)],
    description: Annotated[str, Form(max_length=5000)] = "",
) -> Response:
    name, description = name.strip(), description.strip()
    error = None
    if not TEAM_NAME.fullmatch(name):
        error = "Choose a team name of 1 to 100 characters."
    elif len(description) > 2000:
        error = "Keep the description under 2,000 characters."
    else:
        try:
            team_id = await store_of(request).web.web_write(
                web.create_team,
                name,
                description=description,
                founder_id=session.account.id,
                now=grid_of(request).clock(),
            )
        except (web.TeamExists, web.Conflict):
            error = "A team of that name exists; join it or choose another name."
        else:
            return redirect(request, f"/teams/{team_id}", flash="Your team is made; you are in it.")
    values = {"name": name, "description": description}
    return await render(request, "team_new.html", status=422, values=values, error=error)


@forms.again(r"/teams/new")
async def _team_form_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    values = {"name": typed.get("name", ""), "description": typed.get("description", "")}
    return await render(
        request, "team_new.html", status=422, values=values, error=line, field_errors=errors
    )


@router.get("/teams/{team_id}", response_class=HTMLResponse)
async def team_page(request: Request, team_id: Id, session: Viewer) -> Response:
    store = store_of(request)
    team = await store.web.web_read(web.get_team, team_id)
    if team is None:
        raise PageError(404, f"There is no team {team_id}.")
    members = await store.web.web_read(stats.team_members, team_id, limit=100)
    standing = await store.web.web_read(stats.standing, "teams", team_id)
    return await render(request, "team.html", team=team, members=members, standing=standing)


@router.post("/teams/{team_id}/join", dependencies=[Csrf])
async def join_team(request: Request, team_id: Id, session: SignedIn) -> Response:
    if not await store_of(request).web.web_write(web.join_team, session.account.id, team_id):
        raise PageError(404, f"There is no team {team_id}.")
    return redirect(request, f"/teams/{team_id}", flash="You joined the team.")


@router.post("/teams/leave", dependencies=[Csrf])
async def leave_team(request: Request, session: SignedIn) -> Response:
    await store_of(request).web.web_write(web.leave_team, session.account.id)
    return redirect(request, "/teams", flash="You left your team.")


# -- statistics exports --------------------------------------------------------------------


@router.get("/stats", response_class=HTMLResponse)
async def exports_page(request: Request) -> Response:
    files = exports.listing(dashboard_of(request).settings.data_dir)
    return await render(request, "exports.html", files=files)


@router.get("/stats/{name}")
async def export_file(request: Request, name: str) -> Response:
    path = exports.path_of(dashboard_of(request).settings.data_dir, name)
    if path is None:
        raise PageError(404, "There is no such export (yet: they are written once a day).")
    return FileResponse(path, media_type="application/gzip", filename=name)
