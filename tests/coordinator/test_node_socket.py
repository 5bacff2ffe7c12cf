"""The node WebSocket under TestClient: handshake, bad frames, dispatch, results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Api, bearer, sha
from helpers import NODE_WS, SocketNode, wait_until
from starlette.websockets import WebSocketDisconnect

from idlegrid import protocol
from idlegrid.kinds.sleep import _digest


@pytest.fixture
def node_token(api: Api) -> str:
    return api.token(account="volunteer", kind="node")


@pytest.fixture
def researcher(api: Api) -> str:
    return api.token(account="alice")


@pytest.fixture
def connect(api: Api, node_token: str) -> Iterator[Any]:
    """Open node connections: `connect()` with the volunteer's token, or another one."""
    with contextlib.ExitStack() as stack:

        def open_node(token: str = node_token) -> SocketNode:
            return SocketNode(
                api, stack.enter_context(api.client.websocket_connect(NODE_WS)), token
            )

        yield open_node


def _job(api: Api, token: str, job_id: int) -> dict[str, Any]:
    return api.job(token, job_id)


# -- handshake ------------------------------------------------------------------------------


def test_messages_before_hello_are_out_of_order(connect: Any) -> None:
    node = connect()
    node.ready()
    assert "hello" in node.expect_error("out_of_order")
    node.send(type="heartbeat")
    node.expect_error("out_of_order")
    node.send(type="result", task_id=1, output="ab" * 32, output_size=1, elapsed_s=0)
    node.expect_error("out_of_order")
    node.send(type="failure", task_id=1, reason="x")
    node.expect_error("out_of_order")
    node.join()


BAD_FRAMES: list[tuple[str, str | bytes, str]] = [
    ("not-json", "hello there", "malformed"),
    ("json-array", "[1, 2]", "malformed"),
    ("json-string", '"ready"', "malformed"),
    ("deep-nesting", "[" * 60_000, "malformed"),
    ("unknown-type", '{"type": "gimme"}', "unknown_type"),
    ("no-type", '{"free_slots": 1}', "unknown_type"),
    ("list-type", '{"type": ["ready"]}', "unknown_type"),
    ("server-type", '{"type": "welcome"}', "unknown_type"),
    ("version-2", '{"type": "ready", "v": 2, "free_slots": 1}', "version"),
    ("bad-field", '{"type": "ready", "free_slots": -1}', "malformed"),
    (
        "long-name-hello",
        json.dumps(
            {
                "type": "hello",
                "token": "t",
                "node_key": "node-key-1",
                "name": "n" * 101,
                "worker_version": "1",
                "hardware": {},
                "benchmark": {},
                "slots": 1,
                "kinds": [],
            }
        ),
        "malformed",
    ),
    ("binary-garbage", b"\xff\xfe\x00\x81garbage", "malformed"),
    ("binary-not-object", b"12", "malformed"),
]


def _send_frame(node: SocketNode, frame: str | bytes) -> None:
    if isinstance(frame, bytes):
        node.ws.send_bytes(frame)
    else:
        node.ws.send_text(frame)


@pytest.mark.parametrize(
    ("frame", "code"), [row[1:] for row in BAD_FRAMES], ids=[row[0] for row in BAD_FRAMES]
)
def test_bad_frames_before_hello_get_errors(connect: Any, frame: str | bytes, code: str) -> None:
    node = connect()
    _send_frame(node, frame)
    node.expect_error(code)
    node.join()  # the connection survived


def test_binary_json_frames_are_accepted(connect: Any) -> None:
    node = connect()
    node.ws.send_bytes(json.dumps({"type": "ready", "free_slots": 1}).encode())
    node.expect_error("out_of_order")


@pytest.mark.parametrize("token_kind", ["unknown", "api"])
def test_bad_token_is_unauthorized_and_closes(api: Api, connect: Any, token_kind: str) -> None:
    token = "ign_not-a-token" if token_kind == "unknown" else api.token(account="alice")
    node = connect(token)
    node.hello()
    assert "node token" in node.expect_error("unauthorized")
    with pytest.raises(WebSocketDisconnect) as closed:
        node.recv()
    assert closed.value.code == 4401
    assert api.client.get("/v1/nodes", headers=api.admin).json() == []


def test_a_node_key_belongs_to_one_account(api: Api, connect: Any) -> None:
    connect().join(key="shared-key-1")
    thief = connect(api.token(account="mallory", kind="node"))
    thief.hello(key="shared-key-1")
    assert "another account" in thief.expect_error("unauthorized")
    with pytest.raises(WebSocketDisconnect):
        thief.recv()


def test_second_hello_is_out_of_order(connect: Any) -> None:
    node = connect()
    first = node.join()
    node.hello()
    assert "already" in node.expect_error("out_of_order")
    node.ready()
    node.sync()
    assert first["drop"] == []


def test_connected_node_is_listed(api: Api, connect: Any) -> None:
    node = connect()
    welcome = node.join(kinds=("sleep", "no-such-kind"), slots=3)
    [listed] = api.client.get("/v1/nodes", headers=api.admin).json()
    assert listed["id"] == welcome["node_id"] and listed["online"] is True
    # Kinds the coordinator does not know are dropped.
    assert listed["kinds"] == ["sleep"] and listed["slots"] == 3
    assert listed["hardware"]["memory_mb"] == 4096
    volunteer = bearer(api.token(account="volunteer"))
    assert [n["id"] for n in api.client.get("/v1/nodes", headers=volunteer).json()] == [
        welcome["node_id"]
    ]
    other = bearer(api.token(account="alice"))
    assert api.client.get("/v1/nodes", headers=other).json() == []


# -- protocol versions ----------------------------------------------------------------------


def _hello_frame(node: SocketNode, **fields: Any) -> dict[str, Any]:
    hello = {"type": "hello", "token": node.token, "node_key": "node-key-1",
             "worker_version": "0.9.0", "hardware": {"cpu_cores": 2, "memory_mb": 4096},
             "benchmark": {}, "slots": 1, "kinds": ["sleep"]}  # fmt: skip
    return {**hello, **fields}


def test_a_worker_of_another_major_version_is_refused_naming_both(api: Api, connect: Any) -> None:
    node = connect()
    node.send(**_hello_frame(node, v=2, minor=0, quantum=True))
    refusal = node.expect_error("version")
    assert "protocol version 2" in refusal and f"speaks {protocol.PROTOCOL_VERSION} (1." in refusal
    with pytest.raises(WebSocketDisconnect) as closed:
        node.recv()
    assert closed.value.code == 4426
    assert api.client.get("/v1/nodes", headers=api.admin).json() == []


def test_a_1_0_worker_is_welcomed_with_what_it_knows(connect: Any) -> None:
    node = connect()
    welcome = node.join()  # a hello without `minor`: a 1.0 worker, strict about fields
    assert "minor" not in welcome
    current = connect()
    current.send(**_hello_frame(current, node_key="node-key-2", minor=protocol.PROTOCOL_MINOR))
    assert current.expect("welcome")["minor"] == protocol.PROTOCOL_MINOR


def test_a_newer_workers_optional_fields_are_ignored(
    api: Api, connect: Any, researcher: str
) -> None:
    newer = protocol.PROTOCOL_MINOR + 1
    node = connect()
    node.send(**_hello_frame(node, minor=newer, energy_source="solar",
                             hardware={"cpu_cores": 2, "memory_mb": 4096, "npus": []}))  # fmt: skip
    assert node.expect("welcome")["minor"] == protocol.PROTOCOL_MINOR
    [listed] = api.client.get("/v1/nodes", headers=api.admin).json()
    assert listed["hardware"]["cpu_cores"] == 2 and "npus" not in listed["hardware"]
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    node.send(type="ready", free_slots=1, free_npu_slots=1)
    assign = node.expect("assign", job_id=job["id"])
    output = _digest(assign["shard_index"])
    node.send(type="result", task_id=assign["task_id"], output=node.upload(output),
              output_size=len(output), elapsed_s=0.01, joules=3.5)  # fmt: skip
    node.expect("result_ack", task_id=assign["task_id"], status="accepted")
    # Malformed stays malformed: a wrong type, a value out of range, an unknown type.
    for frame, code in [({"type": "ready", "free_slots": "one"}, "malformed"),
                        ({"type": "ready", "free_slots": -1, "x": 1}, "malformed"),
                        ({"type": "teleport", "x": 1}, "unknown_type")]:  # fmt: skip
        node.send(**frame)
        node.expect_error(code)
    assert _job(api, researcher, job["id"])["state"] == "completed"


def test_an_unknown_field_from_a_worker_of_this_minor_is_malformed(connect: Any) -> None:
    node = connect()
    node.send(**_hello_frame(node, minor=protocol.PROTOCOL_MINOR))
    node.expect("welcome")
    node.send(type="ready", free_slots=1, free_npu_slots=1)
    assert "free_npu_slots" in node.expect_error("malformed")
    node.ready()
    node.sync()  # the connection goes on


# -- after hello ----------------------------------------------------------------------------


def test_errors_after_hello_leave_the_connection_working(
    api: Api, connect: Any, researcher: str
) -> None:
    node = connect()
    node.join()
    for _, frame, code in BAD_FRAMES:
        _send_frame(node, frame)
        node.expect_error(code)
    node.ready()
    node.sync()  # nothing to do yet: no assign came before the sync reply
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    # The node asked for work before there was any: the dispatch loop brings it.
    assign = node.expect("assign", job_id=job["id"], shard_index=0, kind="sleep")
    assert assign["params"] == {"tasks": 1, "seconds": 0.0, "backend": "", "hashes": 0}


def test_full_happy_path(api: Api, connect: Any, researcher: str) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 2})
    node = connect()
    node.join(slots=2)
    node.ready(free_slots=2)
    assigns = [node.expect("assign"), node.expect("assign")]
    assert sorted(a["shard_index"] for a in assigns) == [0, 1]
    assert len({a["task_id"] for a in assigns}) == 2
    running = _job(api, researcher, job["id"])
    assert running["state"] == "running" and running["started_at"] is not None

    for assign in assigns:
        # The input blob is downloadable with the node token and matches its hash.
        got = api.client.get(f"/v1/blobs/{assign['input']['hash']}", headers=bearer(node.token))
        assert got.status_code == 200 and sha(got.content) == assign["input"]["hash"]
        assert len(got.content) == assign["input"]["size"]
        assert json.loads(got.content)["index"] == assign["shard_index"]
        node.result(assign["task_id"], _digest(assign["shard_index"]))
        node.expect("result_ack", task_id=assign["task_id"], status="accepted")

    done = _job(api, researcher, job["id"])
    assert done["state"] == "completed" and done["progress"] == 1.0
    assert done["shards_done"] == 2 and done["tasks_completed"] == 2
    assert all(s["state"] == "done" and s["progress"] == 1.0 for s in done["shards"])
    result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
    assert result.status_code == 200
    assert result.headers["content-type"].startswith("application/json")
    assert result.headers["x-idlegrid-sha256"] == sha(result.content) == done["result"]
    assert json.loads(result.content) == [json.loads(_digest(0)), json.loads(_digest(1))]

    # Sending the same result again is acknowledged as a duplicate and changes nothing.
    node.result(assigns[0]["task_id"], _digest(assigns[0]["shard_index"]))
    node.expect("result_ack", task_id=assigns[0]["task_id"], status="duplicate")
    assert _job(api, researcher, job["id"])["tasks_completed"] == 2


def test_node_gets_no_task_of_a_kind_it_does_not_offer(
    api: Api, connect: Any, researcher: str
) -> None:
    api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join(kinds=("embed-text",))
    node.ready()
    node.sync()  # the reply to the sync frame is the next message: no assign came


def test_ready_gives_no_more_than_free_slots(api: Api, connect: Any, researcher: str) -> None:
    api.submit(researcher, kind="sleep", params={"tasks": 5})
    node = connect()
    node.join(slots=2)
    node.ready(free_slots=1)
    node.expect("assign")
    node.sync()
    node.ready(free_slots=5)  # more than its slots: it gets one more, for two in all
    node.expect("assign")
    node.sync()


def test_results_batch_is_acknowledged_result_by_result(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 3})
    node = connect()
    node.join(slots=3)
    node.ready(free_slots=3)
    assigns = [node.expect("assign") for _ in range(3)]
    batch = []
    for assign in assigns:
        output = _digest(assign["shard_index"])
        batch.append(
            {
                "type": "result",
                "task_id": assign["task_id"],
                "output": node.upload(output),
                "output_size": len(output),
                "elapsed_s": 0.01,
            }
        )
    # One result in the batch is for a task the node never held: it alone is rejected.
    stray = _digest(0)
    batch.append(
        {
            "type": "result",
            "task_id": 987654,
            "output": node.upload(stray),
            "output_size": len(stray),
            "elapsed_s": 0.01,
        }
    )
    node.send(type="results", results=batch)
    for assign in assigns:
        node.expect("result_ack", task_id=assign["task_id"], status="accepted")
    assert "unknown task" in node.expect_error("rejected", task_id=987654)
    done = _job(api, researcher, job["id"])
    assert done["state"] == "completed" and done["tasks_completed"] == 3
    node.send(type="results", results=batch[:1])  # sent again: a duplicate, as alone
    node.expect("result_ack", task_id=assigns[0]["task_id"], status="duplicate")


def test_empty_results_batch_is_malformed(connect: Any) -> None:
    node = connect()
    node.join()
    node.send(type="results", results=[])
    node.expect_error("malformed")


def test_result_for_a_task_the_node_does_not_hold_is_rejected(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    holder, other = connect(), connect()
    holder.join(key="holder-key")
    other.join(key="other-key")
    assign = holder.take()
    before = _job(api, researcher, job["id"])

    other.result(assign["task_id"], _digest(0))
    assert "not held" in other.expect_error("rejected", task_id=assign["task_id"])
    other.result(987654, _digest(0))
    assert "unknown task" in other.expect_error("rejected", task_id=987654)
    after = _job(api, researcher, job["id"])
    assert after == before
    assert after["state"] == "running" and after["shards"][0]["live_tasks"] == 1

    # The holder can still deliver it.
    holder.result(assign["task_id"], _digest(0))
    holder.expect("result_ack", status="accepted")
    assert _job(api, researcher, job["id"])["state"] == "completed"


def test_result_without_uploaded_output_is_rejected(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join()
    assign = node.take()
    node.result(assign["task_id"], _digest(0), upload=False)
    message = node.expect_error("rejected", task_id=assign["task_id"])
    assert "not uploaded" in message
    after = _job(api, researcher, job["id"])
    assert after["state"] == "running" and after["tasks_completed"] == 0


def test_result_with_wrong_size_is_rejected(api: Api, connect: Any, researcher: str) -> None:
    api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join()
    assign = node.take()
    output = _digest(0)
    node.send(
        type="result",
        task_id=assign["task_id"],
        output=node.upload(output),
        output_size=len(output) + 1,
        elapsed_s=0.0,
    )
    assert "bytes" in node.expect_error("rejected", task_id=assign["task_id"])


def test_structurally_wrong_output_is_rejected_and_the_shard_retried(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join()
    assign = node.take()
    node.result(assign["task_id"], b"this is not JSON")
    assert "digest" in node.expect_error("rejected", task_id=assign["task_id"])
    [shard] = _job(api, researcher, job["id"])["shards"]
    assert shard["state"] == "open" and shard["attempts"] == 2 and shard["live_tasks"] == 1

    retry = node.take()
    assert retry["task_id"] != assign["task_id"] and retry["shard_index"] == 0
    node.result(retry["task_id"], _digest(0))
    node.expect("result_ack", task_id=retry["task_id"], status="accepted")
    assert _job(api, researcher, job["id"])["state"] == "completed"


def test_failure_report_requeues_the_shard(api: Api, connect: Any, researcher: str) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join()
    assign = node.take()
    node.send(type="failure", task_id=assign["task_id"], reason="GPU fell off the bus")
    retry = node.take()
    assert retry["task_id"] != assign["task_id"] and retry["shard_index"] == 0
    [shard] = _job(api, researcher, job["id"])["shards"]
    assert shard["attempts"] == 2 and shard["live_tasks"] == 1


def test_heartbeat_progress_shows_in_the_job(api: Api, connect: Any, researcher: str) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 2})
    node = connect()
    node.join()
    assign = node.take()
    node.send(
        type="heartbeat",
        load=0.5,
        seq=7,
        sent_at=1234.5,
        running=[
            {"task_id": assign["task_id"], "progress": 0.5},
            {"task_id": 999, "progress": 0.9},
        ],
    )  # not its task: ignored
    node.expect("heartbeat_ack", seq=7, sent_at=1234.5)
    shards = _job(api, researcher, job["id"])["shards"]
    progress = {s["index"]: s["progress"] for s in shards}
    assert progress == {assign["shard_index"]: 0.5, 1 - assign["shard_index"]: 0.0}
    assert _job(api, researcher, job["id"])["progress"] == 0.0  # no shard is done yet


def test_every_heartbeat_is_acknowledged_with_its_seq(connect: Any) -> None:
    node = connect()
    node.join()
    for seq in (1, 2, 3):
        node.send(type="heartbeat", seq=seq, sent_at=100.0 + seq)
    for seq in (1, 2, 3):
        node.expect("heartbeat_ack", seq=seq, sent_at=100.0 + seq)
    node.send(type="heartbeat")  # an older worker's heartbeat: acknowledged with zeros
    node.expect("heartbeat_ack", seq=0, sent_at=0.0)
    node.sync()


def test_a_heartbeat_is_answered_before_its_presence_is_recorded(
    api: Api, connect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a shared broker recording presence is a round trip; the answer goes first,
    and the next frame is read once the presence is recorded."""
    node = connect()
    node_id = node.join()["node_id"]
    grid = api.client.app.state.grid  # type: ignore[attr-defined]
    broker_up = asyncio.Event()
    recorded: list[int] = []
    node_seen = grid.broker.node_seen

    async def slow_node_seen(seen_id: int, at: float, *, owner: str = "") -> None:
        await broker_up.wait()
        recorded.append(seen_id)
        await node_seen(seen_id, at, owner=owner)

    monkeypatch.setattr(grid.broker, "node_seen", slow_node_seen)
    node.send(type="heartbeat", seq=1, sent_at=5.0)
    node.expect("heartbeat_ack", seq=1, sent_at=5.0)
    assert recorded == []
    node.ws.portal.call(broker_up.set)
    node.sync()
    assert recorded == [node_id, node_id]  # the heartbeat's, then the sync frame's


def test_cancelled_job_tells_the_node(api: Api, connect: Any, researcher: str) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    node = connect()
    node.join()
    assign = node.take()
    cancelled = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(researcher))
    assert cancelled.json()["state"] == "cancelled"
    node.expect("cancel", task_id=assign["task_id"])
    # Its result, if it still sends one, is late and changes nothing.
    node.result(assign["task_id"], _digest(0))
    node.expect("result_ack", task_id=assign["task_id"], status="late")
    assert _job(api, researcher, job["id"])["state"] == "cancelled"


def test_reconnect_keeps_held_tasks_and_drops_unknown_ones(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 2})
    first = connect()
    first.join(slots=2)
    first.ready(free_slots=2)
    kept, lost = first.expect("assign"), first.expect("assign")
    # The node comes back claiming one task it holds and one it never had.
    again = connect()
    welcome = again.join(slots=2, running=(kept["task_id"], 4242))
    assert welcome["drop"] == [4242]
    # The task it forgot was released (no error of the node: a coordinator that died may
    # never have sent it) and went back to the queue as a new task, which it can take.
    again.ready()
    retry = again.expect("assign", shard_index=lost["shard_index"])
    assert retry["task_id"] != lost["task_id"]
    again.result(kept["task_id"], _digest(kept["shard_index"]))
    again.expect("result_ack", task_id=kept["task_id"], status="accepted")
    again.result(retry["task_id"], _digest(retry["shard_index"]))
    again.expect("result_ack", task_id=retry["task_id"], status="accepted")
    assert _job(api, researcher, job["id"])["state"] == "completed"
    trust = api.client.get(f"/v1/nodes/{welcome['node_id']}/trust", headers=api.admin)
    assert [row["errors"] for row in trust.json()] == [0]


def test_replicated_shard_with_disagreeing_results_gets_a_third_node(
    api: Api, connect: Any, researcher: str
) -> None:
    job = api.submit(researcher, kind="sleep", params={"tasks": 1}, replication=2)
    honest, cheat, third = connect(), connect(), connect()
    honest.join(key="honest-key")
    cheat.join(key="cheat-key")
    third.join(key="third-key")
    first = honest.take()
    honest.ready()
    honest.sync()  # one replica per node: the second replica is not for it
    second = cheat.take()
    assert first["shard_index"] == second["shard_index"] == 0
    honest.result(first["task_id"], _digest(0))
    honest.expect("result_ack", status="accepted")
    # Well-formed, so it passes the output check, but it disagrees with the honest one.
    cheat.result(second["task_id"], json.dumps({"index": 0, "digest": "forged"}).encode())
    cheat.expect("result_ack", status="accepted")
    [shard] = _job(api, researcher, job["id"])["shards"]
    assert shard["state"] == "open" and shard["live_tasks"] == 1 and shard["attempts"] == 3

    # Among new nodes (credibility 0.8 each), two that agree against one that does not
    # are not yet enough (posterior 0.76; replication 2 needs 0.94, what two agreeing new
    # nodes give); three against one reach 0.93, four against one 0.98.
    for key in ("third-key", "fourth-key", "fifth-key"):
        node = third if key == "third-key" else connect()
        if key != "third-key":
            node.join(key=key)
        tie_breaker = node.take()
        assert tie_breaker["shard_index"] == 0
        node.result(tie_breaker["task_id"], _digest(0))
        node.expect("result_ack", status="accepted")
    done = _job(api, researcher, job["id"])
    assert done["state"] == "completed" and done["tasks_completed"] == 5
    result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
    assert json.loads(result.content) == [json.loads(_digest(0))]


def test_long_poll_holds_progress_back_but_not_the_end(
    api: Api, connect: Any, researcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards that finish many times a second do not each cost the waiting client a
    round trip (progress is answered PROGRESS_EVERY_S after the request at the soonest);
    the job's end is not held back."""
    monkeypatch.setattr("idlegrid.coordinator.api.jobs.PROGRESS_EVERY_S", 2.0)  # clear of jitter
    job = api.submit(researcher, kind="sleep", params={"tasks": 3})
    node = connect()
    node.join(slots=3)
    node.ready(free_slots=3)
    assigns = [node.expect("assign") for _ in range(3)]
    url = f"/v1/jobs/{job['id']}?wait_s=30&shards=false"
    watch = api.client.app.state.grid.context.job_watch  # type: ignore[attr-defined]

    def poll(results: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
        answer: list[Any] = []
        poller = threading.Thread(
            target=lambda: answer.append(api.client.get(url, headers=bearer(researcher)))
        )
        started = time.monotonic()
        poller.start()
        wait_until(lambda: watch.waiting() == 1, "the long poll to wait", poll_s=0.01)
        for assign in results:
            node.result(assign["task_id"], _digest(assign["shard_index"]))
            node.expect("result_ack", task_id=assign["task_id"], status="accepted")
        poller.join(30)
        return answer[0].json(), time.monotonic() - started

    moved, took = poll(assigns[:1])
    assert moved["shards_done"] == 1 and moved["state"] == "running"
    assert 2.0 <= took < 20
    ended, took = poll(assigns[1:])
    assert ended["state"] == "completed" and took < 2.0
