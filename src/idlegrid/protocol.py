"""Wire messages between a worker node and the coordinator (WebSocket, JSON text frames).

Every message carries `type` (the discriminator) and `v` (the protocol's major version);
`hello` and `welcome` also carry `minor`, each side's minor version. Both sides import
this module and nothing else of each other. It imports nothing of idlegrid.

Compatibility (docs/architecture.md, "Versions"): peers of another major version do not
talk. Within a major, a minor version only adds optional fields (with a default that
means "not said"); a message from a peer of a newer minor may hold fields this side does
not know, which are ignored (and logged at debug). From a peer of this minor or an older
one, an unknown field is refused as `malformed`, as are wrong types, values out of range
and unknown message types, whatever the minor. A sender leaves out the fields added after
its peer's minor (`encode`), so that a peer from before this rule, which refuses every
field it does not know, still reads what it is sent.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1  # the major version, in every message's `v`
# This side's minor version, in `hello` and `welcome`. 1: `minor` itself, and peers that
# ignore the fields of a newer minor; 2: `hello.sequences`. A message without `minor` is
# from a 1.0 peer.
PROTOCOL_MINOR = 2
MAX_MINOR = 10_000
_SPOKEN = f"{PROTOCOL_VERSION} ({PROTOCOL_VERSION}.{PROTOCOL_MINOR})"  # in refusals
# The minor version a field was added in, where that is after 1.0 (`encode` leaves it out
# for older peers): `Field(..., json_schema_extra=_since(2))`.
_SINCE = "since_minor"
# The validation context's key: the message is of a newer minor, its unknown fields go.
_NEWER = "newer_minor"
_Part = TypeVar("_Part", bound=BaseModel)
SHA256_PATTERN = r"^[0-9a-f]{64}$"
BlobHash = Annotated[str, Field(pattern=SHA256_PATTERN)]
# Ids are SQL INTEGER (32-bit in PostgreSQL): a larger one names nothing, and is refused.
MAX_ID = 2**31 - 1
TaskId = Annotated[int, Field(ge=1, le=MAX_ID)]
# Counters and sizes fit the store's 64-bit integers.
MAX_COUNT = 2**63 - 1
# Benchmark figures a node reports: finite and within what any machine reaches. They
# rank candidates for the node; they never set its leases (the coordinator measures).
MAX_GFLOPS = 1e7
MAX_ITEMS_PER_S = 1e9
KindRate = Annotated[float, Field(ge=0.0, le=MAX_ITEMS_PER_S)]
KindName = Annotated[str, Field(min_length=1, max_length=40)]
MAX_BATCH = 256  # results in one `results` message


# Floats on the wire are finite: NaN and infinities are refused with `malformed`.
_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _since(minor: int) -> dict[str, Any]:
    return {_SINCE: minor}


class _Wire(BaseModel):
    """A message or a part of one: unknown fields are refused, except in a message of a
    newer minor version (parsed with the `_NEWER` context), where they are ignored."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _ignore_newer_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not (info.context or {}).get(_NEWER):
            return data
        unknown = [key for key in data if key not in cls.model_fields]
        if not unknown:
            return data
        # Names only, cut short: a peer's frame is not copied into the log.
        names = ", ".join(sorted(str(key)[:40] for key in unknown)[:10])
        log.debug("ignored %s field(s) of a newer minor: %s", cls.__name__, names)
        return {key: value for key, value in data.items() if key in cls.model_fields}


class _Message(_Wire):
    v: Literal[1] = 1


# -- what a node says about itself -----------------------------------------------------


class Gpu(_Wire):
    # The device's number in torch's device strings ("cuda:1"); each GPU is listed alone.
    index: int = Field(default=0, ge=0, le=63)
    backend: Literal["cuda", "rocm", "mps"]
    name: str = Field(max_length=200)
    memory_mb: int = Field(ge=0, le=MAX_COUNT)


class LlamaInfo(_Wire):
    """The node's llama.cpp (llm-generate): its backend, the device it runs on and the
    memory that device has for a model, and its build."""

    backend: str = Field(max_length=20)  # "cpu", "cuda", "metal", "vulkan", "rocm", ...
    device: str = Field(default="", max_length=200)
    memory_mb: int = Field(default=0, ge=0, le=MAX_COUNT)
    version: str = Field(default="", max_length=50)
    # `runtime.build()`: version, backend and CPU features of its kernels. A check goes to
    # a node of the build its output names; an output must name the build its node said.
    build: str = Field(default="", max_length=500)


class HardwareProfile(_Wire):
    os: str = Field(default="", max_length=200)
    cpu_model: str = Field(default="", max_length=200)
    cpu_cores: int = Field(default=1, ge=1, le=4096)
    memory_mb: int = Field(default=0, ge=0, le=MAX_COUNT)
    gpus: list[Gpu] = Field(default_factory=list, max_length=64)
    torch_version: str | None = Field(default=None, max_length=100)
    # Free disk where the worker keeps its blobs; None: not reported (an older worker).
    disk_free_mb: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # Execution providers of the node's ONNX Runtime; empty when it has none.
    onnx_providers: list[str] = Field(default_factory=list, max_length=32)
    # Newest default-domain ONNX opset that runtime loads; None: no runtime, or not said.
    onnx_opset: int | None = Field(default=None, ge=1, le=1000)
    # The node's llama.cpp (llm-generate); None: not installed.
    llama: LlamaInfo | None = None

    @property
    def backends(self) -> frozenset[str]:
        return frozenset({"cpu", *(gpu.backend for gpu in self.gpus)})


class Benchmark(_Wire):
    backend: str = Field(default="cpu", max_length=20)
    matmul_gflops: float = Field(default=0.0, ge=0.0, le=MAX_GFLOPS)
    # Throughput per kind in items per second, e.g. {"embed-text": 350.0}.
    kind_rates: dict[KindName, KindRate] = Field(default_factory=dict, max_length=64)


class TaskProgress(_Wire):
    task_id: TaskId
    progress: float = Field(ge=0.0, le=1.0)
    # The device it runs on ("cuda:1", "cpu"); empty: not started, or not said.
    device: str = Field(default="", max_length=40)


# -- node -> coordinator ---------------------------------------------------------------


class Hello(_Message):
    """First message of a connection: who the node is, what it has, what it holds."""

    type: Literal["hello"] = "hello"
    # The node's minor version of the protocol (absent: 1.0, which sent none).
    minor: int = Field(default=PROTOCOL_MINOR, ge=0, le=MAX_MINOR, json_schema_extra=_since(1))
    token: str = Field(min_length=1, max_length=200)
    node_key: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    name: str = Field(default="", max_length=100)
    worker_version: str = Field(max_length=50)
    hardware: HardwareProfile
    benchmark: Benchmark
    slots: int = Field(ge=1, le=256)
    # Tasks it may hold beyond its slots, queued to start when one frees (a work buffer,
    # as BOINC keeps one): the next task is there when a short one ends.
    prefetch: int = Field(default=0, ge=0, le=256)
    kinds: list[KindName] = Field(max_length=64)
    # Prompts its llm-generate decodes together at most (WorkerSettings.sequences).
    sequences: int = Field(default=1, ge=1, le=256, json_schema_extra=_since(2))
    # Tasks still running or finished-but-unreported from before a reconnect.
    running: list[TaskId] = Field(default_factory=list, max_length=1024)


class Heartbeat(_Message):
    """Every heartbeat interval; the coordinator answers with a `heartbeat_ack`."""

    type: Literal["heartbeat"] = "heartbeat"
    load: float = Field(default=0.0, ge=0.0, le=1e6)
    running: list[TaskProgress] = Field(default_factory=list, max_length=1024)
    # Echoed in the ack, so the node can time the round trip: a counter and the node's
    # own clock (monotonic seconds; the coordinator never interprets it).
    seq: int = Field(default=0, ge=0, le=MAX_COUNT)
    sent_at: float = Field(default=0.0, ge=-1e15, le=1e15)


class DeviceStatus(_Wire):
    """One device of a node (the CPU's slots, or one GPU): its state and why."""

    device: str = Field(max_length=40)  # "cpu", "cuda:1"
    name: str = Field(default="", max_length=200)
    state: Literal["running", "throttled", "paused"]
    reason: str = Field(default="", max_length=300)


class Status(_Message):
    """The node's owner took the machine back (`paused`) or left it (`running`).

    Sent when the worker's idle policy changes its answer, with the policy's reason
    ("paused: user active 3 s ago"). A paused node's tasks are suspended, not lost; it
    asks for no work until it says `running` again, and gives a suspended task back (a
    retryable `failure`) once the task could no longer finish within its lease.
    """

    type: Literal["status"] = "status"
    state: Literal["running", "paused"]
    reason: str = Field(default="", max_length=300)
    # The device its tasks run on ("cpu", "cuda:0"); empty: not said (an older worker).
    device: str = Field(default="", max_length=40)
    # Running below full speed: the owner uses the machine, within the in-use limits.
    throttled: bool = False
    # Each device on its own (empty: not said, an older worker). Sent again whenever a
    # device's state changes; which task runs where, heartbeats say (TaskProgress).
    devices: list[DeviceStatus] = Field(default_factory=list, max_length=65)


class Ready(_Message):
    """The node has `free_slots` free and would like that many tasks."""

    type: Literal["ready"] = "ready"
    free_slots: int = Field(ge=0, le=256)
    # Of those, free GPU slots: a task that needs a GPU goes only there. None: not said
    # (an older worker), judged by the node's hardware alone.
    free_gpu_slots: int | None = Field(default=None, ge=0, le=256)


class Result(_Message):
    type: Literal["result"] = "result"
    task_id: TaskId
    output: BlobHash
    output_size: int = Field(ge=0, le=MAX_COUNT)
    elapsed_s: float = Field(ge=0.0, le=1e9)
    metrics: dict[Annotated[str, Field(max_length=100)], float] = Field(
        default_factory=dict, max_length=64
    )


class Results(_Message):
    """Several results at once (tasks that finished together): one commit for all of them.

    Each is answered as if sent alone (`result_ack` or `error`), after they are all stored.
    """

    type: Literal["results"] = "results"
    results: list[Result] = Field(min_length=1, max_length=MAX_BATCH)


class Failure(_Message):
    type: Literal["failure"] = "failure"
    task_id: TaskId
    reason: str = Field(max_length=2000)
    # False when retrying elsewhere is pointless (e.g. the input itself is bad).
    retryable: bool = True


# -- the volunteer's settings, from the node's local page or the dashboard --------------
#
# Each setting travels with who set it and when: the later of two edits wins, setting by
# setting (docs/worker.md, "Settings from the web"). The coordinator checks every value
# it stores with `check_setting`; a node checks them again against what it can do.

SETTING_NAMES = (
    "control",
    "cpu_mode",
    "gpu_mode",
    "cpu_percent",
    "in_use_cpu_percent",
    "cpu_cores",
    "memory_percent",
    "windows",
    "exclusive_apps",
    "daily_download_mb",
    "paused_gpus",
)
_WINDOW_ENTRY = re.compile(
    r"^(?:(?P<days>[a-z,\-]+)\s+)?(?P<h1>\d{1,2}):(?P<m1>\d{2})\s*-\s*(?P<h2>\d{1,2}):(?P<m2>\d{2})$"
)
_DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
Mode = Literal["always", "idle", "never"]
Percent = Annotated[float, Field(ge=1.0, le=100.0)]


class Control(_Wire):
    """Run, pause, finish the current tasks then pause, or pause until `until`."""

    action: Literal["run", "pause", "finish", "snooze"]
    until: float | None = Field(default=None, ge=0.0, le=1e11)  # epoch seconds, for snooze

    @model_validator(mode="after")
    def _until_for_snooze(self) -> Control:
        if (self.action == "snooze") != (self.until is not None):
            raise ValueError("a snooze, and only a snooze, needs `until`")
        return self


class SettingValues(_Wire):
    """The settings a volunteer edits from either page, each checked on its own."""

    control: Control | None = None
    cpu_mode: Mode | None = None
    gpu_mode: Mode | None = None
    cpu_percent: Percent | None = None  # while idle
    in_use_cpu_percent: Percent | None = None
    cpu_cores: int | None = Field(default=None, ge=0, le=4096)  # 0: all
    memory_percent: Percent | None = None  # the memory cap of task processes
    windows: str | None = Field(default=None, max_length=500)
    exclusive_apps: list[Annotated[str, Field(min_length=1, max_length=100)]] | None = Field(
        default=None, max_length=50
    )
    daily_download_mb: float | None = Field(default=None, ge=0.0, le=1e9)  # 0: no cap
    # GPUs paused on their own, by index (HardwareProfile.gpus); the rest go on.
    paused_gpus: list[Annotated[int, Field(ge=0, le=63)]] | None = Field(
        default=None, max_length=64
    )

    @field_validator("windows")
    @classmethod
    def _windows(cls, value: str | None) -> str | None:
        if value is not None:
            for entry in (part.strip().lower() for part in value.split(";")):
                if entry:
                    check_window(entry)
        return value


def check_window(entry: str) -> None:
    """Refuse a time window that is not "[days] HH:MM-HH:MM", or that is empty."""
    match = _WINDOW_ENTRY.match(entry)
    if match is None:
        raise ValueError(f"{entry!r} is not [days] HH:MM-HH:MM")
    start = (int(match["h1"]), int(match["m1"]))
    end = (int(match["h2"]), int(match["m2"]))
    if start[0] > 23 or start[1] > 59 or (end != (24, 0) and (end[0] > 23 or end[1] > 59)):
        raise ValueError(f"{entry!r} names a time that is not a time of day")
    if start == end or (start == (0, 0) and end == (0, 0)):
        raise ValueError(f"{entry!r} ends when it starts; for a whole day write 00:00-24:00")
    for part in (match["days"] or "").split(","):
        if part and any(day not in _DAY_NAMES for day in part.split("-")):
            raise ValueError(f"unknown day {part!r} in {entry!r} (use mon..sun)")


def check_setting(name: str, value: Any) -> JsonValue:
    """`value` as stored and sent, or ValueError naming the setting and the problem."""
    if name not in SETTING_NAMES:
        raise ValueError(f"{name}: not a setting (one of {', '.join(SETTING_NAMES)})")
    try:
        checked = SettingValues.model_validate({name: value})
    except ValidationError as exc:
        raise ValueError(_describe(exc)) from None
    if getattr(checked, name) is None:
        raise ValueError(f"{name}: a value is needed")
    dumped: JsonValue = checked.model_dump(mode="json")[name]
    return dumped


class Stamped(_Wire):
    """One setting's value, where it was set (`web` or `local`), by whom, and when."""

    value: JsonValue
    source: Literal["web", "local"]
    by: str = Field(default="", max_length=100)
    at: float = Field(ge=0.0, le=1e11)  # epoch seconds (UTC)


SettingName = Annotated[str, Field(min_length=1, max_length=40)]


class SettingsReport(_Message):
    """The settings the node runs with, each with its source, and why it could not apply
    the last ones it was sent (empty: it applied them). Sent after each welcome and
    whenever its settings change."""

    type: Literal["settings_report"] = "settings_report"
    settings: dict[SettingName, Stamped] = Field(default_factory=dict, max_length=64)
    error: str = Field(default="", max_length=500)


# -- coordinator -> node ---------------------------------------------------------------


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    # The coordinator's minor version of the protocol (absent: 1.0, which sent none).
    minor: int = Field(default=PROTOCOL_MINOR, ge=0, le=MAX_MINOR, json_schema_extra=_since(1))
    node_id: int
    heartbeat_interval_s: float
    server_time: datetime
    # Of the tasks the node said it holds, those it should drop (unknown, done, not its).
    drop: list[int] = Field(default_factory=list)
    # Credit the node has earned so far (validated work), shown on its local page.
    credit: float | None = None


class BlobRef(_Wire):
    hash: BlobHash
    size: int = Field(ge=0)


class Assign(_Message):
    type: Literal["assign"] = "assign"
    task_id: TaskId
    job_id: int
    shard_index: int
    kind: str
    params: dict[str, object]
    input: BlobRef
    lease_deadline: datetime
    # A check task (kinds verified by checks): the claimed output to check, not compute.
    check: BlobRef | None = None
    # The task needs a GPU (its job's requirements): the node runs it on a GPU slot.
    gpu: bool = False


class ResultAck(_Message):
    """Answer to `result`: the node may forget the task once it has this."""

    type: Literal["result_ack"] = "result_ack"
    task_id: int
    status: Literal["accepted", "late", "duplicate"]


class HeartbeatAck(_Message):
    """Answer to `heartbeat`, echoing its `seq` and `sent_at` (round-trip time)."""

    type: Literal["heartbeat_ack"] = "heartbeat_ack"
    seq: int
    sent_at: float


class Cancel(_Message):
    type: Literal["cancel"] = "cancel"
    task_id: int
    reason: str


class Settings(_Message):
    """Settings the volunteer changed on the dashboard (or all of them, after a welcome).

    Values are JSON here, checked by the node: one it cannot apply leaves all of its
    settings as they were, and its `settings_report` says why."""

    type: Literal["settings"] = "settings"
    settings: dict[SettingName, Stamped] = Field(default_factory=dict, max_length=64)


class Error(_Message):
    """Answer to a message the coordinator could not take. Nothing changed because of it."""

    type: Literal["error"] = "error"
    code: Literal[
        "malformed",
        "unknown_type",
        "version",
        "out_of_order",
        "unauthorized",
        "rejected",
        "internal",
    ]
    message: str
    task_id: int | None = None


NodeMessage = Annotated[
    Hello | Heartbeat | Status | Ready | Result | Results | Failure | SettingsReport,
    Field(discriminator="type"),
]
ServerMessage = Annotated[
    Welcome | Assign | ResultAck | HeartbeatAck | Cancel | Settings | Error,
    Field(discriminator="type"),
]

_node_adapter: TypeAdapter[NodeMessage] = TypeAdapter(NodeMessage)
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)
NODE_TYPES = frozenset(
    {"hello", "heartbeat", "status", "ready", "result", "results", "failure", "settings_report"}
)
SERVER_TYPES = frozenset(
    {"welcome", "assign", "result_ack", "heartbeat_ack", "cancel", "settings", "error"}
)
# The messages that say their sender's minor version: it holds for the whole connection.
_VERSIONED = frozenset({"hello", "welcome"})


class ProtocolError(ValueError):
    """A frame that is not a valid message; `code` and `message` go into an Error reply.
    `message_type`: the type the frame named, when it named one this side knows."""

    def __init__(self, code: str, message: str, *, message_type: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.message_type = message_type


def parse_node_message(
    frame: str | bytes, *, peer_minor: int = 0
) -> Hello | Heartbeat | Status | Ready | Result | Results | Failure | SettingsReport:
    """Parse one frame from a node, or raise ProtocolError with a readable reason.
    `peer_minor`: the minor version the node's hello said (a hello says its own)."""
    raw, kind = _object_of(frame, NODE_TYPES)
    version = raw.get("v", PROTOCOL_VERSION)
    if not _is_major(version):
        raise ProtocolError(
            "version",
            f"this {kind} is of protocol version {version!r}, and this coordinator speaks "
            f"{_SPOKEN}: run a worker of protocol version {PROTOCOL_VERSION}, as this "
            "coordinator's /download serves",
            message_type=kind,
        )
    return _validate(_node_adapter, raw, kind, peer_minor)


def parse_server_message(
    frame: str | bytes, *, peer_minor: int = 0
) -> Welcome | Assign | ResultAck | HeartbeatAck | Cancel | Settings | Error:
    """Parse one frame from the coordinator (worker side). `peer_minor`: the minor
    version its welcome said (a welcome says its own)."""
    raw, kind = _object_of(frame, SERVER_TYPES)
    version = raw.get("v", PROTOCOL_VERSION)
    if not _is_major(version):
        raise ProtocolError(
            "version",
            f"the coordinator's {kind} is of protocol version {version!r}, and this worker "
            f"speaks {_SPOKEN}: install the worker that the coordinator's /download serves",
            message_type=kind,
        )
    return _validate(_server_adapter, raw, kind, peer_minor)


def encode(message: BaseModel, *, peer_minor: int = PROTOCOL_MINOR) -> str:
    """`message` as a frame for a peer of minor version `peer_minor`: without the fields
    added after that minor, which a peer from before 1.1 would refuse."""
    fields = type(message).model_fields
    newer = {name for name, field in fields.items() if _added_in(field) > peer_minor}
    return message.model_dump_json(exclude=newer)


def read_stored(model: type[_Part], data: object) -> _Part:
    """A node's profile (hardware, benchmark) as the store kept it, which a newer
    coordinator sharing the database may have written: its fields that this version does
    not know are ignored, as in a message of a newer minor; the rest is checked as ever
    (ValidationError)."""
    return model.model_validate(data, context={_NEWER: True})


def _added_in(field: FieldInfo) -> int:
    """The minor version that added the field (0: it was in 1.0)."""
    extra = field.json_schema_extra
    since = extra.get(_SINCE) if isinstance(extra, dict) else None
    return since if isinstance(since, int) else 0


def _object_of(frame: str | bytes, types: frozenset[str]) -> tuple[dict[str, Any], str]:
    """The frame's JSON object and the type it names, one of `types`."""
    try:
        raw = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: deeply nested arrays, which a hostile frame can hold.
        raise ProtocolError("malformed", f"frame is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", "a message must be a JSON object")
    kind = raw.get("type")
    # A non-string type (a list, say) is unhashable: test it before the set lookup.
    if not isinstance(kind, str) or kind not in types:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r}; expected one of {sorted(types)}"
        )
    return raw, kind


def _is_major(version: object) -> bool:
    # `True == 1` in Python: a boolean is no version.
    return not isinstance(version, bool) and version == PROTOCOL_VERSION


def _validate(adapter: TypeAdapter[Any], raw: dict[str, Any], kind: str, peer_minor: int) -> Any:
    """The message `raw` holds, read by the rule for its sender's minor version.

    A hello or a welcome says its sender's minor itself: without one it is from a 1.0
    peer (the model's default is this side's minor); an invalid one is refused by the
    model, and meanwhile counts as no newer minor."""
    if kind in _VERSIONED:
        raw.setdefault("minor", 0)
        minor = raw["minor"]
    else:
        minor = peer_minor
    newer = isinstance(minor, int) and not isinstance(minor, bool) and minor > PROTOCOL_MINOR
    try:
        return adapter.validate_python(raw, context={_NEWER: newer})
    except ValidationError as exc:
        raise ProtocolError("malformed", _describe(exc), message_type=kind) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
