"""Callers of `Grid` never reach past it (docs/architecture.md, "Callers of Grid").

The coordinator's callers (the API, the node socket, the monitor) ask `Grid` for the
grid's work. They never use its broker, hub or context, nor call one of its parts; through
its store they only read records for a response, or write the records no part keeps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COORDINATOR = Path(__file__).parents[2] / "src" / "idlegrid" / "coordinator"
CALLERS = sorted(
    [COORDINATOR / "monitor.py", COORDINATOR / "node_socket.py"]
    + list((COORDINATOR / "api").glob("*.py")),
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
# keeps (accounts and tokens, blob owners, chunked uploads, blob usage).
STORE_READS = {
    "jobs": {"get_job", "list_jobs", "list_shards"},
    "nodes": {"list_nodes", "node_trust"},
    "node_control": {"activity_of"},
}
OWN_RECORDS = {"accounts", "blob_owners", "blob_uploads", "usage"}


def _is_grid(node: ast.expr) -> bool:
    """`grid` or `self.grid`."""
    if isinstance(node, ast.Name):
        return node.id == "grid"
    return isinstance(node, ast.Attribute) and node.attr == "grid"


def reaches(source: str) -> list[str]:
    """Each reach past a grid in `source`, as `line: grid.what`."""
    found = []
    parents: dict[ast.AST, ast.AST] = {}
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_grid(node.value)):
            continue
        if node.attr in PAST_GRID:
            found.append(f"{node.lineno}: grid.{node.attr}")
        elif node.attr == "store":
            role = parents.get(node)
            if not isinstance(role, ast.Attribute):
                continue  # the store handed on whole: to a rule of access (blobs.access)
            method = parents.get(role)
            name = method.attr if isinstance(method, ast.Attribute) else ""
            if role.attr not in OWN_RECORDS and name not in STORE_READS.get(role.attr, ()):
                found.append(f"{node.lineno}: grid.store.{role.attr}.{name}")
    return sorted(found, key=lambda reach: int(reach.split(":")[0]))


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: str(p.relative_to(COORDINATOR)))
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
    )
    assert reaches(source) == [
        "2: grid.store.results.expire_overdue",
        "4: grid.broker",
        "5: grid.rounds",
        "6: grid.context",
    ]
