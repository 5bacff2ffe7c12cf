"""Wire messages: round trips, and every bad frame becomes a ProtocolError with a code."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from idlegrid import protocol
from idlegrid.protocol import (
    Assign,
    Benchmark,
    BlobRef,
    Cancel,
    Error,
    Failure,
    Gpu,
    HardwareProfile,
    Heartbeat,
    HeartbeatAck,
    Hello,
    ProtocolError,
    Ready,
    Result,
    ResultAck,
    Results,
    Status,
    TaskProgress,
    Welcome,
    parse_node_message,
    parse_server_message,
)

HASH = "ab" * 32
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _hello(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "type": "hello",
        "token": "ign_secret",
        "node_key": "node-key-1",
        "worker_version": "0.1.0",
        "hardware": {},
        "benchmark": {},
        "slots": 1,
        "kinds": ["sleep"],
    }
    raw.update(overrides)
    return raw


NODE_MESSAGES: list[BaseModel] = [
    Hello(
        token="ign_secret",
        node_key="node_key-1",
        name="gaming pc",
        worker_version="0.1.0",
        hardware=HardwareProfile(
            os="Linux",
            cpu_model="Ryzen",
            cpu_cores=16,
            memory_mb=32000,
            gpus=[Gpu(backend="cuda", name="RTX 4090", memory_mb=24000)],
            torch_version="2.13",
        ),
        benchmark=Benchmark(
            backend="cuda", matmul_gflops=80000.0, kind_rates={"embed-text": 3500.0}
        ),
        slots=2,
        kinds=["embed-text", "sleep"],
        running=[3, 4],
    ),
    Hello(
        token="t",
        node_key="abcdefgh",
        worker_version="",
        hardware=HardwareProfile(),
        benchmark=Benchmark(),
        slots=1,
        kinds=[],
    ),
    Heartbeat(load=0.5, running=[TaskProgress(task_id=3, progress=0.25)]),
    Heartbeat(),
    Heartbeat(seq=12, sent_at=8123.25),
    Ready(free_slots=2),
    Ready(free_slots=0),
    Status(state="paused", reason="paused: user active 3 s ago"),
    Status(state="running"),
    Result(task_id=7, output=HASH, output_size=123, elapsed_s=1.5, metrics={"items_per_s": 9.0}),
    Failure(task_id=7, reason="out of memory", retryable=False),
    Results(
        results=[
            Result(task_id=7, output=HASH, output_size=1, elapsed_s=0.5),
            Result(task_id=8, output=HASH, output_size=1, elapsed_s=0.25),
        ]
    ),
]

SERVER_MESSAGES: list[BaseModel] = [
    Welcome(node_id=1, heartbeat_interval_s=15.0, server_time=NOW, drop=[5, 6]),
    Welcome(node_id=1, heartbeat_interval_s=15.0, server_time=NOW, credit=12.5),
    Assign(
        task_id=1,
        job_id=2,
        shard_index=0,
        kind="sleep",
        params={"tasks": 1},
        input=BlobRef(hash=HASH, size=10),
        lease_deadline=NOW,
    ),
    ResultAck(task_id=1, status="accepted"),
    ResultAck(task_id=1, status="late"),
    ResultAck(task_id=1, status="duplicate"),
    HeartbeatAck(seq=12, sent_at=8123.25),
    Cancel(task_id=1, reason="job cancelled"),
    Error(code="rejected", message="not yours", task_id=3),
    Error(code="malformed", message="bad"),
]


@pytest.mark.parametrize("message", NODE_MESSAGES, ids=lambda m: type(m).__name__)
def test_node_messages_round_trip(message: BaseModel) -> None:
    frame = message.model_dump_json()
    assert json.loads(frame)["v"] == protocol.PROTOCOL_VERSION
    assert parse_node_message(frame) == message
    assert parse_node_message(frame.encode()) == message


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_server_messages_round_trip(message: BaseModel) -> None:
    assert parse_server_message(message.model_dump_json()) == message


def test_every_message_type_is_covered() -> None:
    node_types = {type(m).__name__ for m in NODE_MESSAGES}
    server_types = {type(m).__name__ for m in SERVER_MESSAGES}
    assert node_types == {
        "Hello", "Heartbeat", "Status", "Ready", "Result", "Results", "Failure",
    }  # fmt: skip
    assert server_types == {"Welcome", "Assign", "ResultAck", "HeartbeatAck", "Cancel", "Error"}
    assert {m.type for m in NODE_MESSAGES} == protocol.NODE_TYPES  # type: ignore[attr-defined]


def test_a_heartbeat_without_seq_is_still_valid() -> None:
    # Workers from before heartbeat_ack send neither field; their heartbeats still count.
    assert parse_node_message('{"type": "heartbeat", "load": 1.0}') == Heartbeat(load=1.0)


def test_heartbeat_ack_needs_what_it_echoes() -> None:
    with pytest.raises(ProtocolError):
        parse_server_message('{"type": "heartbeat_ack", "seq": 1}')
    with pytest.raises(ProtocolError):
        parse_server_message('{"type": "heartbeat_ack", "v": 2, "seq": 1, "sent_at": 0}')


def test_version_defaults_to_current() -> None:
    assert parse_node_message('{"type": "ready", "free_slots": 1}') == Ready(free_slots=1)


def test_hardware_backends_include_cpu_and_gpus() -> None:
    profile = HardwareProfile(
        gpus=[Gpu(backend="cuda", name="a", memory_mb=1), Gpu(backend="mps", name="b", memory_mb=1)]
    )
    assert profile.backends == {"cpu", "cuda", "mps"}
    assert HardwareProfile().backends == {"cpu"}


def _code(frame: str | bytes) -> str:
    with pytest.raises(ProtocolError) as raised:
        parse_node_message(frame)
    assert raised.value.message  # readable reason for the Error reply
    assert str(raised.value) == raised.value.message
    return raised.value.code


@pytest.mark.parametrize(
    "frame",
    [
        "",
        "not json",
        "{",
        b"\xff\xfe\x00",
        "[1, 2]",
        '"ready"',
        "42",
        "null",
        "[" * 100_000,  # nesting deep enough to blow the JSON decoder's recursion
    ],
    ids=["empty", "text", "truncated", "binary", "array", "string", "number", "null", "deep"],
)
def test_non_objects_are_malformed(frame: str | bytes) -> None:
    assert _code(frame) == "malformed"


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"type": "goodbye"},
        {"type": None},
        {"type": 3},
        {"type": ["ready"]},
        {"type": {"a": 1}},
        {"type": "welcome"},
        {"type": "assign"},
        {"type": "READY"},
    ],
    ids=[
        "missing",
        "unknown",
        "null",
        "number",
        "list",
        "object",
        "server-welcome",
        "server-assign",
        "case",
    ],
)
def test_unknown_types(raw: dict[str, Any]) -> None:
    assert _code(json.dumps(raw)) == "unknown_type"


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_other_versions_are_refused(version: object) -> None:
    assert _code(json.dumps({"type": "ready", "v": version, "free_slots": 1})) == "version"


def test_version_error_names_the_version() -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_node_message(json.dumps({"type": "ready", "v": 2, "free_slots": 1}))
    assert "2" in raised.value.message


BAD_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("ready-missing-slots", {"type": "ready"}),
    ("ready-negative", {"type": "ready", "free_slots": -1}),
    ("ready-too-many", {"type": "ready", "free_slots": 257}),
    ("ready-string", {"type": "ready", "free_slots": "two"}),
    ("ready-extra", {"type": "ready", "free_slots": 1, "surprise": True}),
    ("heartbeat-negative-load", {"type": "heartbeat", "load": -1}),
    ("heartbeat-nan-load", {"type": "heartbeat", "load": float("nan")}),
    ("heartbeat-progress>1", {"type": "heartbeat", "running": [{"task_id": 1, "progress": 1.5}]}),
    ("heartbeat-negative-seq", {"type": "heartbeat", "seq": -1}),
    ("heartbeat-string-sent-at", {"type": "heartbeat", "sent_at": "noon"}),
    (
        "result-task-0",
        {"type": "result", "task_id": 0, "output": HASH, "output_size": 1, "elapsed_s": 0},
    ),
    (
        "result-bad-hash",
        {"type": "result", "task_id": 1, "output": "AB" * 32, "output_size": 1, "elapsed_s": 0},
    ),
    (
        "result-short-hash",
        {"type": "result", "task_id": 1, "output": "ab", "output_size": 1, "elapsed_s": 0},
    ),
    (
        "result-negative-size",
        {"type": "result", "task_id": 1, "output": HASH, "output_size": -1, "elapsed_s": 0},
    ),
    ("results-empty", {"type": "results", "results": []}),
    (
        "results-too-many",
        {
            "type": "results",
            "results": [
                {"type": "result", "task_id": i, "output": HASH, "output_size": 1, "elapsed_s": 0}
                for i in range(1, 258)
            ],
        },
    ),
    (
        "results-bad-inner",
        {
            "type": "results",
            "results": [
                {"type": "result", "task_id": 0, "output": HASH, "output_size": 1, "elapsed_s": 0}
            ],
        },
    ),
    ("failure-long-reason", {"type": "failure", "task_id": 1, "reason": "x" * 2001}),
    ("hello-missing-token", {k: v for k, v in _hello().items() if k != "token"}),
    ("hello-empty-token", _hello(token="")),
    ("hello-long-token", _hello(token="t" * 201)),
    ("hello-short-key", _hello(node_key="short")),
    ("hello-long-key", _hello(node_key="k" * 65)),
    ("hello-key-chars", _hello(node_key="bad key/../x")),
    ("hello-long-name", _hello(name="n" * 101)),
    ("hello-long-version", _hello(worker_version="v" * 51)),
    ("hello-zero-slots", _hello(slots=0)),
    ("hello-too-many-slots", _hello(slots=257)),
    ("hello-too-many-kinds", _hello(kinds=["sleep"] * 65)),
    ("hello-too-many-running", _hello(running=list(range(1, 1026)))),
    ("hello-zero-cores", _hello(hardware={"cpu_cores": 0})),
    ("hello-long-cpu-model", _hello(hardware={"cpu_model": "c" * 201})),
    (
        "hello-unknown-backend",
        _hello(hardware={"gpus": [{"backend": "tpu", "name": "x", "memory_mb": 1}]}),
    ),
    (
        "hello-too-many-gpus",
        _hello(hardware={"gpus": [{"backend": "cuda", "name": "x", "memory_mb": 1}] * 65}),
    ),
    ("hello-negative-gflops", _hello(benchmark={"matmul_gflops": -1})),
    ("hello-long-backend", _hello(benchmark={"backend": "b" * 21})),
]


@pytest.mark.parametrize("raw", [raw for _, raw in BAD_FIELDS], ids=[n for n, _ in BAD_FIELDS])
def test_bad_fields_are_malformed(raw: dict[str, Any]) -> None:
    assert _code(json.dumps(raw)) == "malformed"


def test_malformed_message_names_the_field() -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_node_message(json.dumps(_hello(name="n" * 101)))
    assert "name" in raised.value.message


def test_a_valid_hello_at_the_limits_parses() -> None:
    hello = parse_node_message(
        json.dumps(
            _hello(
                token="t" * 200,
                node_key="k" * 64,
                name="n" * 100,
                slots=256,
                kinds=["sleep"] * 64,
            )
        )
    )
    assert isinstance(hello, Hello) and hello.slots == 256


def test_server_parser_refuses_bad_frames() -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_server_message('{"type": "assign"}')
    assert raised.value.code == "malformed"
    with pytest.raises(ProtocolError):
        parse_server_message('{"type": "ready", "free_slots": 1}')
    with pytest.raises(ProtocolError):
        parse_server_message("not json")
    with pytest.raises(ProtocolError):
        parse_server_message('{"type": "cancel", "v": 2, "task_id": 1, "reason": "x"}')


def test_messages_are_frozen() -> None:
    with pytest.raises(ValidationError):
        Ready(free_slots=1).free_slots = 2  # type: ignore[misc]
