"""A volunteer's pages: my nodes, add a node, one node with its charts."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, Response

from idlegrid.dashboard.accounts import make_token
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    SignedIn,
    Viewer,
    grid_of,
    render,
    store_of,
)
from idlegrid.store import stats, web
from idlegrid.store.base import NodeRecord, NodeTrust
from idlegrid.verification import trust as trust_policy

router = APIRouter()
HISTORY_DAYS = 60


@dataclass(frozen=True)
class NodeView:
    """A node as the "my nodes" page shows it."""

    node: NodeRecord
    online: bool
    live_tasks: int
    validated: int
    trust: list[NodeTrust]
    trusted: bool

    @property
    def gflops(self) -> float:
        return float(self.node.benchmark.get("matmul_gflops") or 0.0)

    @property
    def backends(self) -> list[str]:
        gpus = self.node.hardware.get("gpus") or []
        return sorted({"cpu", *(str(g.get("backend", "")) for g in gpus if g.get("backend"))})

    @property
    def gpus(self) -> list[dict[str, Any]]:
        return list(self.node.hardware.get("gpus") or [])


async def connected_ids(request: Request) -> set[int]:
    """Nodes connected to this coordinator process or, with Redis, to any."""
    grid = grid_of(request)
    return set(await grid.broker.connections()) | {s.node_id for s in grid.hub.sessions()}


async def my_nodes(request: Request, account_id: int) -> list[NodeView]:
    grid = grid_of(request)
    store = store_of(request)
    nodes = await grid.store.nodes.list_nodes(account_id)
    ids = [node.id for node in nodes]
    live = await store.web.web_read(web.live_tasks, ids)
    validated = await store.web.web_read(web.validated_counts, ids)
    connected = await connected_ids(request)
    trusts = await store.web.web_read(web.trust_of_nodes, ids, now=grid.clock())
    views = []
    for node in nodes:
        trust = trusts.get(node.id, [])
        views.append(
            NodeView(
                node=node,
                online=node.id in connected,
                live_tasks=live.get(node.id, 0),
                validated=validated.get(node.id, 0),
                trust=trust,
                trusted=any(trust_policy.is_trusted(t.trust, grid.trust) for t in trust),
            )
        )
    return views


@router.get("/my/nodes", response_class=HTMLResponse)
async def nodes_page(request: Request, session: SignedIn) -> Response:
    views = await my_nodes(request, session.account.id)
    return await render(request, "my_nodes.html", nodes=views, live=False)


@router.get("/my/nodes/live", response_class=HTMLResponse)
async def nodes_live(request: Request, session: SignedIn) -> Response:
    """The node table alone, refreshed in place every few seconds."""
    views = await my_nodes(request, session.account.id)
    return await render(request, "_node_table.html", nodes=views, live=True)


@router.get("/my/nodes/add", response_class=HTMLResponse)
async def add_node_page(request: Request, session: SignedIn) -> Response:
    return await render(request, "add_node.html", commands=None, name="", error=None)


@router.post("/my/nodes/add", response_class=HTMLResponse, dependencies=[Csrf])
async def add_node(
    request: Request, session: SignedIn, name: Annotated[str, Form(max_length=200)] = ""
) -> Response:
    name = name.strip()
    if len(name) > 100:
        return await render(
            request,
            "add_node.html",
            status=422,
            commands=None,
            name=name,
            error="Choose a node name of at most 100 characters.",
        )
    secret = await make_token(request, session.account.id, kind="node", label=name or "node")
    return await render(
        request,
        "add_node.html",
        commands=worker_commands(str(request.base_url).rstrip("/"), secret, name),
        name=name,
        token=secret,
        error=None,
    )


def worker_commands(server: str, token: str, name: str) -> list[tuple[str, str]]:
    """What a volunteer types on the new machine, quoted for a POSIX shell."""
    start = f"idlegrid worker --server {shlex.quote(server)} --token {shlex.quote(token)}"
    if name:
        start += f" --name {shlex.quote(name)}"
    return [
        ("Install the worker (Python 3.11 or newer)", 'python3 -m pip install "idlegrid[worker]"'),
        ("Start it with this node's token", start),
    ]


@router.get("/nodes/{node_id}", response_class=HTMLResponse)
async def node_page(request: Request, node_id: Id, session: Viewer) -> Response:
    """A node's public page: hardware, credit, and its validated work per day."""
    store = store_of(request)
    standing = await store.web.web_read(stats.standing, "nodes", node_id)
    if standing is None:
        raise PageError(404, f"There is no node {node_id}.")
    node = next(
        (
            n
            for n in await grid_of(request).store.nodes.list_nodes(standing.parent_id)
            if n.id == node_id
        ),
        None,
    )
    history = await store.web.web_read(stats.node_history, node_id, days=HISTORY_DAYS)
    mine = session is not None and session.account.id == standing.parent_id
    return await render(
        request,
        "node.html",
        standing=standing,
        node=node,
        online=node_id in await connected_ids(request),
        history=history,
        mine=mine,
        charts=history_chart(history, now=grid_of(request).clock()),
    )


def history_chart(history: list[stats.Period], *, now: float) -> dict[str, Any]:
    """Series for the charts: credit and validated tasks per day, cumulative credit."""
    running = 0.0
    cumulative = []
    for period in history:
        running += period.credit
        cumulative.append(round(running, 4))
    start = min([p.start for p in history] + [now - 14 * 86_400])
    return {
        "range": [start, now + 86_400],
        "x": [p.start for p in history],
        "credit": [round(p.credit, 4) for p in history],
        "validated": [p.validated for p in history],
        "cumulative": cumulative,
    }
