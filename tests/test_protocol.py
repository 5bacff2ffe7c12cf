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
    Status(state="running", reason="running: user active 2 s ago", throttled=True),
    Result(task_id=7, output=HASH, output_size=123, elapsed_s=1.5, metrics={"items_per_s": 9.0}),
    Failure(task_id=7, reason="out of memory", retryable=False),
    protocol.SettingsReport(
        settings={"cpu_percent": protocol.Stamped(value=50.0, source="local", by="me", at=1.0)},
        error="could not apply the dashboard's settings: cpu_cores: 64 is more than 8",
    ),
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
    protocol.Settings(
        settings={"control": protocol.Stamped(value={"action": "pause"}, source="web", at=2.0)}
    ),
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
        "SettingsReport",
    }  # fmt: skip
    assert server_types == {
        "Welcome", "Assign", "ResultAck", "HeartbeatAck", "Cancel", "Settings", "Error",
    }  # fmt: skip
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


# -- versions: a newer minor's optional fields are ignored, another major is refused ------

NEWER = protocol.PROTOCOL_MINOR + 1
# What a 1.0 worker sent: no `minor`, none of the optional fields added since.
HELLO_1_0 = _hello(hardware={"cpu_cores": 4, "memory_mb": 8000}, benchmark={"matmul_gflops": 5.0})
RESULT_1_0 = {"type": "result", "v": 1, "task_id": 7, "output": HASH, "output_size": 3,
              "elapsed_s": 0.5}  # fmt: skip
# Fields a newer minor might add, at the top and inside nested objects.
HELLO_NEWER = _hello(
    minor=NEWER,
    energy_source="solar",
    hardware={"cpu_cores": 4, "memory_mb": 8000, "npus": [{"name": "x"}],
              "gpus": [{"backend": "cuda", "name": "A", "memory_mb": 1, "pcie_gen": 5}]},
    benchmark={"matmul_gflops": 5.0, "int8_tops": 9.0},
)  # fmt: skip


def test_an_older_workers_hello_and_result_are_accepted() -> None:
    hello = parse_node_message(json.dumps(HELLO_1_0))
    assert isinstance(hello, Hello) and hello.minor == 0 and hello.prefetch == 0
    assert hello.hardware.disk_free_mb is None and hello.hardware.llama is None
    result = parse_node_message(json.dumps(RESULT_1_0), peer_minor=0)
    assert result == Result(task_id=7, output=HASH, output_size=3, elapsed_s=0.5)


def test_this_sides_messages_say_its_minor() -> None:
    hello = json.loads(NODE_MESSAGES[0].model_dump_json())
    assert (hello["v"], hello["minor"]) == (protocol.PROTOCOL_VERSION, protocol.PROTOCOL_MINOR)
    parsed = parse_node_message(json.dumps(hello))
    assert isinstance(parsed, Hello) and parsed.minor == protocol.PROTOCOL_MINOR


def test_a_newer_minors_unknown_fields_are_ignored_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("DEBUG", logger="idlegrid.protocol"):
        hello = parse_node_message(json.dumps(HELLO_NEWER))
    assert isinstance(hello, Hello) and hello.minor == NEWER
    assert hello.hardware.gpus == [Gpu(backend="cuda", name="A", memory_mb=1)]
    assert hello.benchmark == Benchmark(matmul_gflops=5.0)
    ignored = " ".join(record.getMessage() for record in caplog.records)
    for name in ("energy_source", "npus", "pcie_gen", "int8_tops"):
        assert name in ignored
    assert "ign_secret" not in ignored  # names only: no values in the log
    # Later messages are read by the minor the hello said.
    heartbeat = {"type": "heartbeat", "seq": 1, "battery": 0.5,
                 "running": [{"task_id": 3, "progress": 0.5, "watts": 90}]}  # fmt: skip
    assert parse_node_message(json.dumps(heartbeat), peer_minor=NEWER) == Heartbeat(
        seq=1, running=[TaskProgress(task_id=3, progress=0.5)]
    )
    batch = {"type": "results", "results": [{**RESULT_1_0, "joules": 12.0}]}
    assert parse_node_message(json.dumps(batch), peer_minor=NEWER) == Results(
        results=[Result(task_id=7, output=HASH, output_size=3, elapsed_s=0.5)]
    )


@pytest.mark.parametrize("minor", [0, protocol.PROTOCOL_MINOR])
def test_unknown_fields_from_this_minor_or_an_older_one_are_malformed(minor: int) -> None:
    # A peer of this minor knows every field this side knows: an unknown one is a bug.
    assert _code(json.dumps({**_hello(minor=minor), "energy_source": "solar"})) == "malformed"
    heartbeat = {"type": "heartbeat", "running": [{"task_id": 3, "progress": 0.5, "w": 1}]}
    with pytest.raises(ProtocolError) as raised:
        parse_node_message(json.dumps(heartbeat), peer_minor=minor)
    assert raised.value.code == "malformed" and "running.0.w" in raised.value.message


NEWER_BUT_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("wrong-type", _hello(minor=NEWER, slots="two", extra=1), "malformed"),
    ("out-of-range", _hello(minor=NEWER, slots=0), "malformed"),
    ("missing-field", {k: v for k, v in _hello(minor=NEWER).items() if k != "token"}, "malformed"),
    ("nested-wrong-type", _hello(minor=NEWER, hardware={"cpu_cores": "many"}), "malformed"),
    ("minor-not-a-number", _hello(minor="2", extra=1), "malformed"),
    ("minor-negative", _hello(minor=-1), "malformed"),
    ("minor-boolean", _hello(minor=True, extra=1), "malformed"),
    ("minor-huge", _hello(minor=10**6), "malformed"),
    ("nan", {**_hello(minor=NEWER), "benchmark": {"matmul_gflops": float("nan")}}, "malformed"),
    ("unknown-type", {"type": "goodbye", "minor": NEWER}, "unknown_type"),
    ("other-major", _hello(minor=NEWER, v=2), "version"),
]


@pytest.mark.parametrize(
    ("raw", "code"), [row[1:] for row in NEWER_BUT_BAD], ids=[row[0] for row in NEWER_BUT_BAD]
)
def test_a_newer_minor_is_still_refused_what_is_malformed(raw: dict[str, Any], code: str) -> None:
    assert _code(json.dumps(raw)) == code


def test_a_newer_minor_loosens_nothing_but_unknown_fields() -> None:
    for raw in ({"type": "ready", "free_slots": -1, "x": 1}, {"type": "ready", "x": 1},
                {"type": "heartbeat", "load": "high"}):  # fmt: skip
        with pytest.raises(ProtocolError) as raised:
            parse_node_message(json.dumps(raw), peer_minor=NEWER)
        assert raised.value.code == "malformed"
    with pytest.raises(ProtocolError) as raised:
        parse_node_message('{"type": "gimme", "x": 1}', peer_minor=NEWER)
    assert raised.value.code == "unknown_type"


def test_another_major_is_refused_naming_both_versions() -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_node_message(json.dumps(_hello(v=2)))
    refusal = raised.value
    assert refusal.code == "version" and refusal.message_type == "hello"
    assert "protocol version 2" in refusal.message
    assert f"speaks {protocol.PROTOCOL_VERSION} (1.{protocol.PROTOCOL_MINOR})" in refusal.message
    welcome = {**json.loads(SERVER_MESSAGES[0].model_dump_json()), "v": 2}
    with pytest.raises(ProtocolError) as raised:
        parse_server_message(json.dumps(welcome))
    assert raised.value.code == "version" and "protocol version 2" in raised.value.message
    assert f"speaks {protocol.PROTOCOL_VERSION} (1." in raised.value.message


def test_the_worker_ignores_a_newer_coordinators_fields() -> None:
    welcome = {**json.loads(SERVER_MESSAGES[0].model_dump_json()), "minor": NEWER, "motd": "hi"}
    parsed = parse_server_message(json.dumps(welcome))
    assert isinstance(parsed, Welcome) and parsed.minor == NEWER and parsed.drop == [5, 6]
    assign = {**json.loads(SERVER_MESSAGES[2].model_dump_json()), "priority": 3}
    assign["input"]["region"] = "eu"
    assert parse_server_message(json.dumps(assign), peer_minor=NEWER) == SERVER_MESSAGES[2]
    with pytest.raises(ProtocolError) as raised:  # from this minor: a bug, refused
        parse_server_message(json.dumps(assign), peer_minor=protocol.PROTOCOL_MINOR)
    assert raised.value.code == "malformed"
    with pytest.raises(ProtocolError) as raised:
        parse_server_message('{"type": "reboot", "minor": 9}', peer_minor=NEWER)
    assert raised.value.code == "unknown_type"


# What a 1.0 worker's strict Welcome model knew.
WELCOME_1_0 = {"type", "v", "node_id", "heartbeat_interval_s", "server_time", "drop", "credit"}


def test_a_peer_is_sent_only_the_fields_its_minor_knows() -> None:
    welcome = Welcome(node_id=1, heartbeat_interval_s=15.0, server_time=NOW)
    assert set(json.loads(protocol.encode(welcome, peer_minor=0))) == WELCOME_1_0
    current = json.loads(protocol.encode(welcome, peer_minor=protocol.PROTOCOL_MINOR))
    assert current["minor"] == protocol.PROTOCOL_MINOR and set(current) - WELCOME_1_0 == {"minor"}
    ready = Ready(free_slots=1)
    assert protocol.encode(ready, peer_minor=0) == ready.model_dump_json()


# -- the volunteer's settings ------------------------------------------------------------

GOOD_SETTINGS = [
    ("cpu_mode", "always", "always"),
    ("cpu_percent", 1, 1.0),
    ("cpu_percent", 100, 100.0),
    ("cpu_cores", 0, 0),
    ("memory_percent", 75.5, 75.5),
    ("windows", "18:00-08:00; sat,sun 00:00-24:00", "18:00-08:00; sat,sun 00:00-24:00"),
    ("windows", "", ""),
    ("exclusive_apps", ["steam", "blender"], ["steam", "blender"]),
    ("daily_download_mb", 0, 0.0),
    ("control", {"action": "pause"}, {"action": "pause", "until": None}),
    ("control", {"action": "snooze", "until": 5.0}, {"action": "snooze", "until": 5.0}),
]
BAD_SETTINGS = [
    ("cpu_percent", 0, "greater than or equal to 1"),
    ("cpu_percent", 101, "less than or equal to 100"),
    ("cpu_percent", "half", "valid number"),
    ("cpu_mode", "sometimes", "'always', 'idle' or 'never'"),
    ("cpu_cores", -1, "greater than or equal to 0"),
    ("windows", "10:00-10:00", "ends when it starts"),
    ("windows", "9-17", "is not [days] HH:MM-HH:MM"),
    ("windows", "25:00-26:00", "not a time of day"),
    ("windows", "fun 10:00-12:00", "unknown day"),
    ("daily_download_mb", -5, "greater than or equal to 0"),
    ("control", {"action": "snooze"}, "needs `until`"),
    ("control", {"action": "explode"}, "control.action"),
    ("colour", "blue", "not a setting"),
    ("cpu_mode", None, "a value is needed"),
]


@pytest.mark.parametrize(("name", "value", "stored"), GOOD_SETTINGS)
def test_settings_a_node_can_take(name: str, value: Any, stored: Any) -> None:
    assert protocol.check_setting(name, value) == stored


@pytest.mark.parametrize(("name", "value", "problem"), BAD_SETTINGS)
def test_settings_refused_with_a_reason_naming_them(name: str, value: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=r"^" + name) as refused:
        protocol.check_setting(name, value)
    assert problem in str(refused.value)


def test_a_profile_from_the_store_ignores_a_newer_versions_fields() -> None:
    gpu = {"backend": "cuda", "name": "A", "memory_mb": 2, "bus": "pcie"}
    stored = {"cpu_cores": 4, "sensors": {"fan": 1}, "gpus": [gpu]}
    assert protocol.read_stored(HardwareProfile, stored) == HardwareProfile(
        cpu_cores=4, gpus=[Gpu(backend="cuda", name="A", memory_mb=2)]
    )
    with pytest.raises(ValidationError):
        protocol.read_stored(HardwareProfile, {"cpu_cores": 0, "sensors": {}})
    with pytest.raises(ValidationError):  # read as a message of this version: strict
        HardwareProfile.model_validate(stored)
