"""Callers of `Grid` never reach past it (docs/architecture.md, "Callers of Grid").

The coordinator's callers (the API, the node socket, the monitor, the dashboard and the
app that composes them) ask `Grid` for the grid's work. They never use its broker, hub or
context, nor call one of its parts; through its store they only read records for a
response, or write the records no part keeps. `app.py` closes the store and the broker it
made through its own names for them, not through the grid.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "src" / "idlegrid"
COORDINATOR = PACKAGE / "coordinator"
CALLERS = sorted(
    [COORDINATOR / "monitor.py", COORDINATOR / "node_socket.py", PACKAGE / "app.py"]
    + list((COORDINATOR / "api").glob("*.py"))
    + list((PACKAGE / "dashboard").glob("*.py")),
)

# What a caller never names on a grid: the shared resources a part works with, and the
# parts themselves.
PAST_GRID = {
    "broker",
    "hub",
    "context",
    "plans",
    "matcher",
    "fanout",
    "rounds",
    "leases",
    "fleet",
    "intake",
    "dispatcher",
    "verification",
    "stalemates",
    "results",
    "node_control",
}
# Through the store: reads for a response, and the records no part of the coordinator
# keeps (accounts and tokens, blob owners, chunked uploads, blob usage, and the
# dashboard's own through `store.web`: browser sessions, teams, password accounts).
STORE_READS = {
    "jobs": {"get_job", "list_jobs", "list_shards"},
    "nodes": {"list_nodes", "node_trust"},
    "node_control": {"activity_of", "credit_on_day", "settings_of", "tasks_now"},
}
OWN_RECORDS = {"accounts", "blob_owners", "blob_uploads", "usage", "web"}


def _is_call_of(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _is_grid(node: ast.expr) -> bool:
    """`grid`, `self.grid`, `request.app.state.grid` or the dashboard's `grid_of(request)`."""
    if isinstance(node, ast.Name):
        return node.id == "grid"
    if _is_call_of(node, "grid_of"):
        return True
    return isinstance(node, ast.Attribute) and node.attr == "grid"


def _is_store(node: ast.expr, names: set[str]) -> bool:
    """A grid's store: `grid.store`, the dashboard's `store_of(request)`, or a name given
    either (`store = store_of(request)`)."""
    if isinstance(node, ast.Name):
        return node.id in names
    if _is_call_of(node, "store_of"):
        return True
    return isinstance(node, ast.Attribute) and node.attr == "store" and _is_grid(node.value)


def _store_names(tree: ast.AST) -> set[str]:
    """The names a module gives a grid's store."""
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_store(node.value, set())
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def reaches(source: str) -> list[str]:
    """Each reach past a grid in `source`, as `line: grid.what`."""
    found = []
    parents: dict[ast.AST, ast.AST] = {}
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    store_names = _store_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_grid(node.value) and node.attr in PAST_GRID:
            found.append(f"{node.lineno}: grid.{node.attr}")
        elif _is_store(node.value, store_names):
            # A role of the store (the store handed on whole, to a rule of access such as
            # blobs.access, names none).
            method = parents.get(node)
            name = method.attr if isinstance(method, ast.Attribute) else ""
            if node.attr not in OWN_RECORDS and name not in STORE_READS.get(node.attr, ()):
                found.append(f"{node.lineno}: grid.store.{node.attr}.{name}")
    return sorted(found, key=lambda reach: int(reach.split(":")[0]))


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_callers_never_reach_past_grid(path: Path) -> None:
    assert reaches(path.read_text()) == []


def test_the_check_finds_reaches() -> None:
    source = (
        "async def f(grid, self):\n"
        "    await grid.store.results.expire_overdue(now=1)\n"
        "    await grid.store.jobs.get_job(1)\n"
        "    await self.grid.broker.silent_nodes(before=1)\n"
        "    await grid.rounds.close_due()\n"
        "    await peers.attach(grid.context, None)\n"
        "    await grid.store.accounts.add_token(1)\n"
        "    await grid.expire_overdue()\n"
        "    await request.app.state.grid.hub.sessions()\n"
        "    await metrics.render(grid_of(request).context)\n"
        "    await store_of(request).web.web_read(fn)\n"
        "    store = store_of(request)\n"
        "    await store.node_control.tasks_now([1])\n"
        "    await store.rounds.close_round(1)\n"
        "    await grid_of(request).store.claims.claim_task(1)\n"
    )
    assert reaches(source) == [
        "2: grid.store.results.expire_overdue",
        "4: grid.broker",
        "5: grid.rounds",
        "6: grid.context",
        "9: grid.hub",
        "10: grid.context",
        "14: grid.store.rounds.close_round",
        "15: grid.store.claims.claim_task",
    ]
