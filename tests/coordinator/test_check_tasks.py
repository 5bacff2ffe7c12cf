"""Kinds verified by a check task on another node, not by replicas (`TaskKind.checks`).

A toy kind defined here: a shard's output is its payload in capitals; a check task gets
that claimed output (`RunContext.check`) and says whether it is right. Through the
in-process grid, on SQLite and PostgreSQL: an honest output is checked once and counts;
a lie is failed by two checkers, made again by an honest node and checked; a lying
checker is outvoted. The coordinator knows the kind by its hooks alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeNode, fake_node
from sqlalchemy import select, update

from idlegrid import protocol
from idlegrid.blobs.files import BlobStore
from idlegrid.broker.memory import MemoryBroker
from idlegrid.coordinator.grid import Grid
from idlegrid.kinds import KINDS, get_kind
from idlegrid.kinds.base import KindParams, RunContext, ShardSpec, TaskKind, Verdict
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.ledger import load_trust
from idlegrid.store.schema import node_trust, tasks
from idlegrid.store.sql import SqlStore
from idlegrid.verification import probes
from idlegrid.verification.trust import TrustSettings

NAME = "toy-check"
T0 = 1_000_000.0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CapitalsKind(TaskKind):
    name = NAME
    params_model = KindParams
    input_names = ("lines",)
    checks = True
    default_replication = 2

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        lines = inputs["lines"].split()
        return [ShardSpec(i, line, 1, 1e6) for i, line in enumerate(lines)]

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        if ctx.check is None:
            return payload.upper()
        verdict = {"claimed": sha(ctx.check), "passed": ctx.check == payload.upper()}
        return json.dumps({"check": verdict}).encode()

    def check_verdict(self, output: bytes) -> tuple[str, bool] | None:
        if not output.startswith(b'{"check"'):
            return None
        found = json.loads(output)["check"]
        return found["claimed"], found["passed"]

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        first, second = self.check_verdict(a), self.check_verdict(b)
        if first is None and second is None:
            return Verdict.AGREE if a == b else Verdict.INCONCLUSIVE
        if first is not None and second is not None:
            return Verdict.AGREE if first == second else Verdict.INCONCLUSIVE
        check, output = (first, b) if first is not None else (second, a)
        assert check is not None
        if check[0] != sha(output):
            return Verdict.INCONCLUSIVE
        return Verdict.AGREE if check[1] else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        return b" ".join(outputs)


@pytest.fixture(autouse=True)
def second_pass(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the next shards are drawn for a second pass (none, unless a test says)."""
    drawn = [False]
    monkeypatch.setattr(probes, "wants_second_pass", lambda *, draw: drawn[-1])
    return drawn


@pytest.fixture
async def grid(store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Grid]:
    monkeypatch.setitem(KINDS, NAME, CapitalsKind())
    grid = Grid(
        settings=CoordinatorSettings(data_dir=tmp_path / "coordinator"),
        store=store,
        broker=MemoryBroker(),
        blobs=BlobStore(tmp_path / "blobs", max_bytes=1 << 30),
        clock=lambda: T0,
    )
    yield grid
    await grid.aclose()


async def _nodes(
    grid: Grid, store: SqlStore, names: Sequence[str] | Mapping[str, str], *,
    kind: str = NAME, now: float = T0, net: int = 0,
) -> dict[str, FakeNode]:  # fmt: skip
    """A volunteer's node each, on networks 10.`net`.i; `names` a mapping: name -> the
    llama.cpp build its session reports."""
    builds = names if isinstance(names, Mapping) else {}
    nodes = {}
    for i, name in enumerate(names):
        account = await store.accounts.create_account(f"volunteer-{name}", is_admin=False, now=now)
        node = await fake_node(
            store, account.id, name, now=now, kinds=[kind], address=f"10.{net}.{i}.1"
        )
        if name in builds:
            node.session.llama_build = builds[name]
        grid.hub.add(node.session)
        nodes[name] = node
    return nodes


async def _claim(grid: Grid, node: FakeNode) -> dict[str, Any] | None:
    """Take one task as a node's `ready` does: its assignment, or None."""
    before = len(node.assigned())
    node.session.requested = 1
    await grid.fill(node.session)
    return node.assigned()[-1] if len(node.assigned()) > before else None


async def _send(grid: Grid, node: FakeNode, assign: dict[str, Any], output: bytes) -> None:
    message = protocol.Result(task_id=assign["task_id"], output=grid.blobs.put(output),
                              output_size=len(output), elapsed_s=0.1)  # fmt: skip
    await grid.accept_result(node.session, message)


async def _work(grid: Grid, node: FakeNode, *, lie: bool = False) -> dict[str, Any] | None:
    """Take one task as a node's `ready` does, run the kind (or lie), send the result."""
    assign = await _claim(grid, node)
    if assign is None:
        return None
    kind = get_kind(NAME)
    check = grid.blobs.read(assign["check"]["hash"]) if assign.get("check") else None
    payload = grid.blobs.read(assign["input"]["hash"])
    output = kind.run(payload, KindParams(), RunContext(check=check))
    if lie:
        output = payload.lower() if check is None else output.replace(b"true", b"false")
    await _send(grid, node, assign, output)
    return assign


async def _submit(
    grid: Grid, store: SqlStore, lines: bytes, *, kind: str = NAME, now: float = T0,
    researcher: str = "alice",
) -> int:  # fmt: skip
    account = await store.accounts.create_account(researcher, is_admin=False, now=now)
    job = await grid.submit_job(
        account_id=account.id, kind_name=kind, inputs={"lines": grid.blobs.put(lines)},
        params={}, replication=None, priority=0,
    )  # fmt: skip
    return job.id


async def _establish(store: SqlStore, *nodes: FakeNode, kind: str = NAME) -> None:
    """Give these nodes a checker's record the known-answer checks established."""
    async with store.engine.begin() as conn:
        for node in nodes:
            await load_trust(
                conn, node.session.node_id, kind, "cpu", settings=TrustSettings(), now=T0
            )
            await conn.execute(
                update(node_trust)
                .where(node_trust.c.node_id == node.session.node_id, node_trust.c.kind == kind)
                .values(probes_passed=probes.ESTABLISHED_AFTER)
            )


async def _credit(store: SqlStore) -> dict[str, float]:
    return {r.name: r.credit.total for r in await store.nodes.list_nodes()}


async def test_an_output_is_checked_once_by_an_established_checker_and_counts(
    grid: Grid, store: SqlStore
) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["a", "b"])
    await _establish(store, nodes["b"])
    made = await _work(grid, nodes["a"])
    assert made is not None and made.get("check") is None  # the output first, alone
    assert await _work(grid, nodes["a"]) is None  # its check never goes to the same node
    checked = await _work(grid, nodes["b"])
    assert checked is not None and checked["check"]["hash"] == sha(b"ABC")
    # The checking node may read the claimed output it was given, no other node may.
    accounts = {name: n.session.account_id for name, n in nodes.items()}
    assert await store.blob_owners.tasks_name(accounts["b"], sha(b"ABC"), since=T0 - 60)
    job = await store.jobs.get_job(job_id)
    assert job is not None and job.state == "completed"
    assert grid.blobs.read(job.result_hash or "") == b"ABC"
    credit = await _credit(store)
    # The pass is paid once a known-answer check confirms its node's word.
    assert credit["a"] > 0 and credit["b"] == 0.0


async def test_a_new_checkers_pass_waits_for_a_second_from_another_account(
    grid: Grid, store: SqlStore
) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["a", "new1", "new2"])
    await _work(grid, nodes["a"])
    await _work(grid, nodes["new1"])
    assert await _state(store, job_id) == "running"  # one lazy checker cannot decide it
    second = await _work(grid, nodes["new2"])
    assert second is not None and second["check"]["hash"] == sha(b"ABC")
    assert await _state(store, job_id) == "completed"


async def test_a_shard_drawn_for_a_second_pass_asks_one_of_an_established_checker_too(
    grid: Grid, store: SqlStore, second_pass: list[bool]
) -> None:
    """Two checkers passing each other's lies cannot know where a third looks too."""
    second_pass.append(True)
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["a", "b", "c"])
    await _establish(store, nodes["b"])
    await _work(grid, nodes["a"])
    await _work(grid, nodes["b"])
    assert await _state(store, job_id) == "running"
    second = await _work(grid, nodes["c"])
    assert second is not None and second["check"]["hash"] == sha(b"ABC")
    assert await _state(store, job_id) == "completed"


async def test_a_second_pass_no_node_can_give_is_not_waited_for(
    grid: Grid, store: SqlStore, second_pass: list[bool]
) -> None:
    second_pass.append(True)
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["a", "b"])
    await _establish(store, nodes["b"])
    await _work(grid, nodes["a"])
    await _work(grid, nodes["b"])
    assert await _state(store, job_id) == "running"
    await grid.settle_stalled()  # the established checker's pass decides it after all
    assert await _state(store, job_id) == "completed"


async def test_a_lie_in_a_pool_of_four_is_made_again_and_checked_by_who_caught_it(
    grid: Grid, store: SqlStore
) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["liar", "c1", "c2", "honest"])
    lie = await _work(grid, nodes["liar"], lie=True)
    assert lie is not None
    first = await _work(grid, nodes["c1"])
    assert first is not None and first["check"]["hash"] == sha(b"abc")
    assert await _state(store, job_id) == "running"  # one failed check: confirmed first
    second = await _work(grid, nodes["c2"])
    assert second is not None and second["check"]["hash"] == sha(b"abc")
    remade = await _work(grid, nodes["honest"])
    assert remade is not None and remade.get("check") is None  # the lie is out: made again
    # The checks that caught the lie bar nobody: their nodes check the new output.
    for name in ("c1", "c2"):
        again = await _work(grid, nodes[name])
        assert again is not None and again["check"]["hash"] == sha(b"ABC")
    job = await store.jobs.get_job(job_id)
    assert job is not None and job.state == "completed"
    assert grid.blobs.read(job.result_hash or "") == b"ABC"
    credit = await _credit(store)
    assert credit["liar"] == 0.0 and credit["honest"] > 0
    assert credit["c1"] > 0 and credit["c2"] > 0  # the checks that caught the lie


async def test_a_lying_checker_is_outvoted(grid: Grid, store: SqlStore) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["maker", "liar", "c1", "c2"])
    await _work(grid, nodes["maker"])
    await _work(grid, nodes["liar"], lie=True)  # fails an honest output
    await _work(grid, nodes["c1"])  # 1 : 1, another check
    assert await _state(store, job_id) == "running"
    await _work(grid, nodes["c2"])
    assert await _state(store, job_id) == "completed"  # 2 : 1 for the output
    credit = await _credit(store)
    assert credit["liar"] == 0.0 and credit["maker"] > 0


async def test_a_decision_that_makes_a_verdict_the_result_is_refused(
    grid: Grid, store: SqlStore
) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["a", "b"])
    await _work(grid, nodes["a"])
    check = await _work(grid, nodes["b"])
    assert check is not None
    (shard,) = await store.jobs.list_shards(job_id)
    outcome = await store.verification.decide_shard(
        shard.id, canonical_task_id=check["task_id"], valid=[check["task_id"]], invalid=[],
        fail_reason=None, now=T0,
    )  # fmt: skip
    assert not outcome.decided
    (shard,) = await store.jobs.list_shards(job_id)
    assert shard.state == "open" and shard.output_hash is None


async def test_a_job_whose_result_cannot_be_built_fails_and_others_complete(
    grid: Grid, store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = await _submit(grid, store, b"boom")
    fine = await _submit(grid, store, b"abc", researcher="bea")
    nodes = await _nodes(grid, store, ["a", "b"])
    await _establish(store, nodes["b"])
    kind = get_kind(NAME)

    def assemble(outputs: Sequence[bytes], params: KindParams) -> bytes:
        if b"BOOM" in outputs:
            raise ValueError("a shard's output is not what the kind expects")
        return b" ".join(outputs)

    monkeypatch.setattr(kind, "assemble", assemble)
    for _ in range(2):
        await _work(grid, nodes["a"])
        await _work(grid, nodes["b"])
    job = await store.jobs.get_job(broken)
    assert job is not None and job.state == "failed"
    assert job.error == (
        "its result could not be assembled: ValueError: a shard's output is not what the "
        "kind expects"
    )
    assert await _state(store, fine) == "completed"


# -- known-answer checks: the checkers checked -----------------------------------------


class PlantingKind(CapitalsKind):
    """The toy kind with known-answer checks: a planted claim is the output in lower case."""

    def plant_defect(self, output: bytes, draw: float) -> bytes | None:
        return output.lower()


async def _lazy(grid: Grid, node: FakeNode) -> dict[str, Any] | None:
    """A lazy checker: passes every claim it is given without reading it."""
    assign = await _claim(grid, node)
    if assign is None:
        return None
    if not assign.get("check"):
        output = grid.blobs.read(assign["input"]["hash"]).upper()
    else:
        verdict = {"claimed": assign["check"]["hash"], "passed": True}
        output = json.dumps({"check": verdict}).encode()
    await _send(grid, node, assign, output)
    return assign


@pytest.fixture
def planting(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Known-answer checks on: the next claims of checks become known-answer checks
    while the list's last value is True."""
    monkeypatch.setitem(KINDS, NAME, PlantingKind())
    send = [True]
    monkeypatch.setattr(probes, "sends_probe", lambda trust, *, draw: send[-1])
    return send


async def test_a_lazy_checker_fails_a_known_answer_and_the_shard_is_checked_anyway(
    grid: Grid, store: SqlStore, planting: list[bool]
) -> None:
    job_id = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["maker", "lazy", "c1", "c2"])
    await _work(grid, nodes["maker"])
    probe = await _lazy(grid, nodes["lazy"])
    assert probe is not None and probe["check"]["hash"] == sha(b"abc")  # the planted claim
    planting.append(False)
    # The shard's own check was queued beside it: two new checkers pass the output.
    for name in ("c1", "c2"):
        real = await _work(grid, nodes[name])
        assert real is not None and real["check"]["hash"] == sha(b"ABC")
    job = await store.jobs.get_job(job_id)
    assert job is not None and job.state == "completed"
    assert grid.blobs.read(job.result_hash or "") == b"ABC"  # never the planted claim
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                select(tasks.c.outcome, tasks.c.known_answer).where(tasks.c.id == probe["task_id"])
            )
        ).one()
        trust = (
            await conn.execute(
                select(node_trust.c.invalid_total, node_trust.c.probes_passed).where(
                    node_trust.c.node_id == nodes["lazy"].session.node_id
                )
            )
        ).one()
    assert tuple(row) == ("invalid", "fail")  # a lie, as an outvoted result is
    assert tuple(trust) == (1, 0)
    assert (await _credit(store))["lazy"] == 0.0


async def test_a_right_known_answer_pays_the_checkers_earlier_passes(
    grid: Grid, store: SqlStore, planting: list[bool]
) -> None:
    planting.append(False)
    first = await _submit(grid, store, b"abc")
    nodes = await _nodes(grid, store, ["maker", "c1", "c2"])
    await _work(grid, nodes["maker"])
    await _work(grid, nodes["c1"])
    await _work(grid, nodes["c2"])
    assert await _state(store, first) == "completed"
    assert (await _credit(store))["c1"] == 0.0  # held: no known answer confirms it yet
    await _submit(grid, store, b"xyz", researcher="bea")
    await _work(grid, nodes["maker"])
    planting.append(True)
    probe = await _work(grid, nodes["c1"])  # an honest check fails the planted claim
    assert probe is not None and probe["check"]["hash"] == sha(b"xyz")
    async with store.engine.connect() as conn:
        passed = (
            await conn.execute(
                select(node_trust.c.probes_passed).where(
                    node_trust.c.node_id == nodes["c1"].session.node_id
                )
            )
        ).scalar_one()
    assert passed == 1
    credit = await _credit(store)
    # Its pass and its answer; the maker has one output decided so far.
    assert credit["c1"] == pytest.approx(2 * credit["maker"])
    assert credit["c2"] == 0.0  # no known answer of its own yet


async def test_replication_one_takes_the_output_unchecked(grid: Grid, store: SqlStore) -> None:
    researcher = await store.accounts.create_account("rita", is_admin=False, now=T0)
    job = await grid.submit_job(
        account_id=researcher.id, kind_name=NAME, inputs={"lines": grid.blobs.put(b"abc")},
        params={}, replication=1, priority=0,
    )  # fmt: skip
    nodes = await _nodes(grid, store, ["solo"])
    assert await _work(grid, nodes["solo"]) is not None
    assert await _work(grid, nodes["solo"]) is None  # no check: nothing more to do
    done = await store.jobs.get_job(job.id)
    assert done is not None and done.state == "completed"


# -- outputs that name their build: checks go to that build, and only they can pass ------

BUILT = "toy-build-check"
WAIT_S = 300.0


class BuildKind(CapitalsKind):
    """The toy kind, with an output that names its build; a "near" output (a cheat
    within other builds' noise) passes every check but one on the build it names."""

    name = BUILT
    names_builds = True

    def claimed_build(self, output: bytes) -> str:
        return str(json.loads(output)["build"])

    def check_decides(self, output: bytes) -> bool:
        return bool(json.loads(output)["check"].get("decides", True))


@pytest.fixture
async def built_grid(
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Grid, list[float]]]:
    monkeypatch.setitem(KINDS, BUILT, BuildKind())
    now = [T0]
    grid = Grid(
        settings=CoordinatorSettings(data_dir=tmp_path / "coordinator", check_build_wait_s=WAIT_S),
        store=store,
        broker=MemoryBroker(),
        blobs=BlobStore(tmp_path / "blobs", max_bytes=1 << 30),
        clock=lambda: now[0],
    )
    yield grid, now
    await grid.aclose()


async def _built_nodes(
    grid: Grid, store: SqlStore, builds: Mapping[str, str], now: float
) -> dict[str, FakeNode]:
    return await _nodes(grid, store, builds, kind=BUILT, now=now, net=1)


async def _built_work(
    grid: Grid, node: FakeNode, *, near: bool = False, names: str | None = None,
    short: bool = False,
) -> dict[str, Any] | None:  # fmt: skip
    """One task on a node of the build its session reported: an output naming `names`
    (default that build), or a check that fails a "near" output only on its own build;
    a "short" output's pass on another build decides nothing."""
    assign = await _claim(grid, node)
    if assign is None:
        return None
    payload = grid.blobs.read(assign["input"]["hash"])
    build = node.session.llama_build
    if assign.get("check"):
        claimed = json.loads(grid.blobs.read(assign["check"]["hash"]))
        right = claimed["text"] == payload.upper().decode()
        passed = right and not (claimed["near"] and claimed["build"] == build)
        decides = claimed["build"] == build or not claimed.get("short")
        verdict = {"claimed": assign["check"]["hash"], "passed": passed, "decides": decides}
        output = json.dumps({"check": verdict})
    else:
        named = build if names is None else names
        text = payload.upper().decode()
        output = json.dumps({"text": text, "build": named, "near": near, "short": short})
    await _send(grid, node, assign, output.encode())
    return assign


async def _submit_built(grid: Grid, store: SqlStore, now: float) -> int:
    return await _submit(grid, store, b"abc", kind=BUILT, now=now, researcher="bob")


async def _state(store: SqlStore, job_id: int) -> str:
    job = await store.jobs.get_job(job_id)
    assert job is not None
    return job.state


async def test_a_check_waits_for_a_node_of_the_outputs_build(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"maker": "A", "other": "B", "peer": "A"}, now[0])
    assert await _built_work(grid, nodes["maker"], near=True) is not None
    now[0] += WAIT_S - 1
    assert await _built_work(grid, nodes["other"]) is None  # waits for build A
    checked = await _built_work(grid, nodes["peer"])
    assert checked is not None and checked.get("check")
    assert await _state(store, job_id) == "running"  # the near cheat failed on its build


async def test_a_job_says_its_check_waits_for_a_build_no_connected_node_runs(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"maker": "A", "other": "B"}, now[0])
    await _built_work(grid, nodes["maker"])
    now[0] += 100

    async def waits() -> list[str]:
        job = await store.jobs.get_job(job_id)
        assert job is not None
        return [w for w in await grid.waiting_for(job) if "build its output names" in w]

    (reason,) = await waits()
    maker = nodes["maker"].session.node_id
    assert reason.startswith(
        f"shard 0 waits for a check on the build its output names (A; node {maker} made it)"
    )
    assert "for up to 200 s more" in reason and "cross-build margins" in reason
    now[0] += WAIT_S  # past the wait: other builds check it, nothing to say
    assert await waits() == []
    now[0] -= WAIT_S
    await _built_nodes(grid, store, {"peer": "A"}, now[0])  # a node of its build comes
    assert await waits() == []


async def test_an_honest_output_passes_its_own_builds_check(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"maker": "A", "other": "B", "peer": "A"}, now[0])
    await _establish(store, nodes["peer"], kind=BUILT)
    await _built_work(grid, nodes["maker"])
    assert await _built_work(grid, nodes["other"]) is None  # waits for build A first
    assert await _built_work(grid, nodes["peer"]) is not None
    assert await _state(store, job_id) == "completed"
    credit = await _credit(store)
    assert credit["maker"] > 0 and credit["other"] == 0.0


async def test_a_build_no_other_node_has_is_checked_by_other_builds_and_paid(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    """A node on rare hardware: after the wait for its build, two other builds' passes
    (two accounts) make its output canonical, and it is paid."""
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"rare": "X", "b1": "B", "c1": "C"}, now[0])
    await _built_work(grid, nodes["rare"])
    assert await _built_work(grid, nodes["b1"]) is None  # waits for build X first
    now[0] += WAIT_S + 1
    first = await _built_work(grid, nodes["b1"])
    assert first is not None and first.get("check")
    assert await _state(store, job_id) == "running"  # one new checker's pass: a second
    second = await _built_work(grid, nodes["c1"])
    assert second is not None and second["check"]["hash"] == first["check"]["hash"]
    assert await _state(store, job_id) == "completed"
    assert (await _credit(store))["rare"] > 0


async def test_a_checked_shard_no_node_can_help_waits_then_fails_with_a_reason(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    """Two nodes: the output and one new checker's pass, and no third node for the second
    pass. The shard waits, saying so, for the checker's record; then the stalemate pass
    fails it by the checking rule, naming what it needs, never taking a verdict as its
    result."""
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"maker": "A", "peer": "A"}, now[0])
    await _built_work(grid, nodes["maker"])
    await _built_work(grid, nodes["peer"])
    await grid.settle_stalled()
    job = await store.jobs.get_job(job_id)
    assert job is not None and job.state == "running"
    waits = await grid.waiting_for(job)
    (reason,) = [w for w in waits if "record" in w]
    peer = nodes["peer"].session.node_id
    assert reason.startswith(f"shard 0: its output passed a check by node {peer}, whose record")
    now[0] += CoordinatorSettings().check_confirm_wait_s + 1
    await grid.settle_stalled()
    job = await store.jobs.get_job(job_id)
    assert job is not None and job.state == "failed"
    assert "one more check of its output" in (job.error or "")
    (shard,) = await store.jobs.list_shards(job_id)
    assert shard.output_hash is None


async def test_a_short_output_of_a_build_no_other_node_has_is_made_again_unblamed(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    """Too few tokens for another build's pass to decide: after two such passes the
    output is set aside (neither valid nor invalid) and made again on a common build."""
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    builds = {"rare": "X", "b1": "B", "c1": "C", "b2": "B"}
    nodes = await _built_nodes(grid, store, builds, now[0])
    made = await _built_work(grid, nodes["rare"], short=True)
    assert made is not None
    now[0] += WAIT_S + 1
    for name in ("b1", "c1"):
        shrug = await _built_work(grid, nodes[name])
        assert shrug is not None and shrug.get("check")
    remade = await _built_work(grid, nodes["b2"])
    assert remade is not None and not remade.get("check")  # set aside: made again
    # Their passes of the set-aside output bar nobody; build C waits for build B first.
    again = await _built_work(grid, nodes["b1"])
    assert again is not None and again.get("check")
    now[0] += WAIT_S + 1
    again = await _built_work(grid, nodes["c1"])
    assert again is not None and again.get("check")
    assert await _state(store, job_id) == "completed"
    async with store.engine.connect() as conn:
        found = select(tasks.c.outcome).where(tasks.c.id == made["task_id"])
        assert (await conn.execute(found)).scalar_one() == "moot"
    credit = await _credit(store)
    assert credit["rare"] == 0.0 and credit["b2"] > 0
    async with store.engine.connect() as conn:
        blamed = select(node_trust.c.invalid_total).where(
            node_trust.c.node_id == nodes["rare"].session.node_id
        )
        assert (await conn.execute(blamed)).scalar_one() == 0


async def test_an_output_naming_another_build_than_its_node_is_invalid(
    built_grid: tuple[Grid, list[float]], store: SqlStore
) -> None:
    """A node that reported build A cannot have its output checked as build B's."""
    grid, now = built_grid
    job_id = await _submit_built(grid, store, now[0])
    nodes = await _built_nodes(grid, store, {"liar": "A", "b": "B", "honest": "B"}, now[0])
    await _establish(store, nodes["b"], kind=BUILT)
    lie = await _built_work(grid, nodes["liar"], near=True, names="B")
    assert lie is not None
    remade = await _built_work(grid, nodes["honest"])
    assert remade is not None and not remade.get("check")  # the lie is out: made again
    assert await _built_work(grid, nodes["b"]) is not None
    assert await _state(store, job_id) == "completed"
    credit = {r.name: r.credit.total for r in await store.nodes.list_nodes()}
    assert credit["liar"] == 0.0
    async with store.engine.connect() as conn:
        found = select(tasks.c.outcome, tasks.c.build).where(tasks.c.id == lie["task_id"])
        row = (await conn.execute(found)).one()
    assert tuple(row) == ("invalid", "A")  # its node's build, as it reported it


async def test_a_caught_checkers_lone_passes_are_checked_again_or_named_as_doubts(
    grid: Grid, store: SqlStore, planting: list[bool]
) -> None:
    """An established checker whose pass alone decided shards is caught by a known
    answer: the open job's shard it decided is checked again; the job that already
    ended names it on its page."""
    planting.append(False)
    nodes = await _nodes(grid, store, ["a", "b", "c", "d"])
    await _establish(store, nodes["b"])
    ended = await _submit(grid, store, b"xyz")
    await _work(grid, nodes["a"])
    await _lazy(grid, nodes["b"])  # an honest output, passed unread, stands alone
    assert await _state(store, ended) == "completed"
    running = await _submit(grid, store, b"abc def", researcher="bea")
    await _work(grid, nodes["a"])
    await _lazy(grid, nodes["b"])
    shard0, _ = await store.jobs.list_shards(running)
    assert shard0.state == "done"
    await _work(grid, nodes["a"])  # shard 1's output
    planting.append(True)
    probe = await _lazy(grid, nodes["b"])  # passes the planted claim: caught
    assert probe is not None and probe["check"]["hash"] == sha(b"def")
    planting.append(False)
    shard0, _ = await store.jobs.list_shards(running)
    assert shard0.state == "open"  # its output rested on b's word alone
    b = nodes["b"].session.node_id
    job = await store.jobs.get_job(ended)
    assert job is not None
    assert await grid.doubts(job) == [
        f"shard 0: its output was accepted on one check, by node {b}, which was caught "
        "lying since; its job had ended, so it was not checked again"
    ]
    for name in ("c", "d", "c", "d"):
        await _work(grid, nodes[name])
    job = await store.jobs.get_job(running)
    assert job is not None and job.state == "completed"
    assert grid.blobs.read(job.result_hash or "") == b"ABC DEF"
    assert await grid.doubts(job) == []


async def test_a_pass_is_paid_only_once_its_job_completed_with_the_output(
    grid: Grid, store: SqlStore, planting: list[bool]
) -> None:
    """A right known answer confirms a checker's word, but a pass of an output is paid
    only once its job completed with that output: not while it runs, never if it fails."""
    planting.append(False)
    nodes = await _nodes(grid, store, ["a", "b", "c"])
    running = await _submit(grid, store, b"abc def")
    await _work(grid, nodes["a"])
    await _work(grid, nodes["b"])
    await _work(grid, nodes["c"])  # shard 0 decided on two passes, shard 1 still to make
    await _submit(grid, store, b"xyz", researcher="bea")
    await _work(grid, nodes["a"])  # shard 1 of the first job, or the second job's output
    planting.append(True)
    probe = await _work(grid, nodes["b"])  # an honest checker answers it right
    assert probe is not None
    planting.append(False)
    unit = (await _credit(store))["a"]  # one output decided so far: one shard's price
    assert (await _credit(store))["b"] == pytest.approx(unit)  # its answer, not its pass
    for _ in range(4):
        for name in ("c", "a", "b"):
            await _work(grid, nodes[name])
    assert await _state(store, running) == "completed"
    assert (await _credit(store))["b"] >= 2 * unit - 1e-12  # its pass paid with the job
