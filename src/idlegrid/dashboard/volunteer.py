"""A volunteer's pages: my nodes, add a node, one node with its charts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, Response

from idlegrid.dashboard import downloads, forms
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
from idlegrid.store.node_control import Activity
from idlegrid.verification import trust as trust_policy

router = APIRouter()
HISTORY_DAYS = 60
SILENT_AFTER_S = 86_400.0  # a node not heard from for this long is marked silent


@dataclass(frozen=True)
class TaskDoing:
    task_id: int
    job_id: int
    kind: str
    progress: float | None  # None: its heartbeats reach another coordinator process
    device: str = ""  # where it runs ("cuda:1"), as its heartbeats say


@dataclass(frozen=True)
class NodeView:
    """A node as the "my nodes" page shows it."""

    node: NodeRecord
    online: bool
    live_tasks: int
    validated: int
    trust: list[NodeTrust]
    trusted: bool
    # What it does now: its tasks (with progress where this process hears its
    # heartbeats), what it last said (running or paused, why, its device), its credit
    # today and whether it has been silent for a day.
    doing: list[TaskDoing] = field(default_factory=list)
    activity: Activity | None = None
    credit_today: float = 0.0
    silent: bool = False
    control: str = "run"
    # GPUs the owner paused on their own (the `paused_gpus` setting), by index.
    paused_gpus: frozenset[int] = frozenset()

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


async def said_of_itself(request: Request, node_id: int) -> tuple[str, str]:
    """What a node's worker last said of itself ("paused", "throttled", "running") and why."""
    found = (await store_of(request).node_control.activity_of([node_id])).get(node_id)
    return (found.state, found.reason) if found else ("", "")


async def connected_ids(request: Request) -> set[int]:
    """Nodes connected to this coordinator process or, with Redis, to any."""
    return await grid_of(request).connected()


async def my_nodes(request: Request, account_id: int) -> list[NodeView]:
    grid = grid_of(request)
    store = store_of(request)
    nodes = await grid.store.nodes.list_nodes(account_id)
    ids = [node.id for node in nodes]
    live = await store.web.web_read(web.live_tasks, ids)
    validated = await store.web.web_read(web.validated_counts, ids)
    connected = await connected_ids(request)
    trusts = await store.web.web_read(web.trust_of_nodes, ids, now=grid.clock())
    now = grid.clock()
    activity = await store.node_control.activity_of(ids)
    today = await store.node_control.credit_on_day(ids, day=int(now // 86_400))
    doing = await _doing(request, ids)
    controls = await store.node_control.settings_of(ids)
    views = []
    for node in nodes:
        trust = trusts.get(node.id, [])
        control = controls[node.id].get("control")
        views.append(
            NodeView(
                node=node,
                online=node.id in connected,
                live_tasks=live.get(node.id, 0),
                validated=validated.get(node.id, 0),
                trust=trust,
                trusted=any(trust_policy.is_trusted(t.trust, grid.trust) for t in trust),
                doing=doing.get(node.id, []),
                activity=activity.get(node.id),
                credit_today=today.get(node.id, 0.0),
                silent=node.id not in connected and now - node.last_seen_at > SILENT_AFTER_S,
                control=_control_word(control.value if control else None, now),
                paused_gpus=_paused_gpus(controls[node.id].get("paused_gpus")),
            )
        )
    return views


async def _doing(request: Request, ids: list[int]) -> dict[int, list[TaskDoing]]:
    """The tasks each node holds, with progress from the heartbeats this process hears."""
    grid = grid_of(request)
    out: dict[int, list[TaskDoing]] = {}
    for task in await store_of(request).node_control.tasks_now(ids):
        heard = grid.task_heard(task.node_id, task.task_id)
        progress, device = heard if heard is not None else (None, "")
        out.setdefault(task.node_id, []).append(
            TaskDoing(task.task_id, task.job_id, task.kind, progress, device)
        )
    return out


def _paused_gpus(row: Any) -> frozenset[int]:
    value = row.value if row is not None else None
    if not isinstance(value, list):
        return frozenset()
    return frozenset(i for i in value if isinstance(i, int) and not isinstance(i, bool))


def _control_word(value: Any, now: float) -> str:
    """What the owner last asked of the node: run, pause, finish, or snooze (still on)."""
    if not isinstance(value, dict):
        return "run"
    action = str(value.get("action", "run"))
    if action == "snooze" and float(value.get("until") or 0) <= now:
        return "run"
    return action


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
    packages = await downloads.shelf_of(request).packages()
    return await render(
        request,
        "add_node.html",
        commands=downloads.node_commands(downloads.server_of(request), packages, name=name),
        name=name,
        token=secret,
        error=None,
    )


@forms.again(r"/my/nodes/add")
async def _add_node_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    return await render(
        request,
        "add_node.html",
        status=422,
        commands=None,
        name=typed.get("name", ""),
        error=line,
        field_errors=errors,
    )


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
        activity=await said_of_itself(request, node_id) if mine else ("", ""),
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
