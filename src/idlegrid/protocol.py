"""Wire messages between a worker node and the coordinator (WebSocket, JSON text frames).

Every message carries `type` (the discriminator) and `v` (the protocol version). Both
sides import this module and nothing else of each other. It imports nothing of idlegrid.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
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


class _Message(BaseModel):
    model_config = _STRICT
    v: Literal[1] = 1


# -- what a node says about itself -----------------------------------------------------


class Gpu(BaseModel):
    model_config = _STRICT
    backend: Literal["cuda", "rocm", "mps"]
    name: str = Field(max_length=200)
    memory_mb: int = Field(ge=0, le=MAX_COUNT)


class HardwareProfile(BaseModel):
    model_config = _STRICT
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

    @property
    def backends(self) -> frozenset[str]:
        return frozenset({"cpu", *(gpu.backend for gpu in self.gpus)})


class Benchmark(BaseModel):
    model_config = _STRICT
    backend: str = Field(default="cpu", max_length=20)
    matmul_gflops: float = Field(default=0.0, ge=0.0, le=MAX_GFLOPS)
    # Throughput per kind in items per second, e.g. {"embed-text": 350.0}.
    kind_rates: dict[KindName, KindRate] = Field(default_factory=dict, max_length=64)


class TaskProgress(BaseModel):
    model_config = _STRICT
    task_id: TaskId
    progress: float = Field(ge=0.0, le=1.0)


# -- node -> coordinator ---------------------------------------------------------------


class Hello(_Message):
    """First message of a connection: who the node is, what it has, what it holds."""

    type: Literal["hello"] = "hello"
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


class Ready(_Message):
    """The node has `free_slots` free and would like that many tasks."""

    type: Literal["ready"] = "ready"
    free_slots: int = Field(ge=0, le=256)


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


# -- coordinator -> node ---------------------------------------------------------------


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    node_id: int
    heartbeat_interval_s: float
    server_time: datetime
    # Of the tasks the node said it holds, those it should drop (unknown, done, not its).
    drop: list[int] = Field(default_factory=list)
    # Credit the node has earned so far (validated work), shown on its local page.
    credit: float | None = None


class BlobRef(BaseModel):
    model_config = _STRICT
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
    Hello | Heartbeat | Status | Ready | Result | Results | Failure, Field(discriminator="type")
]
ServerMessage = Annotated[
    Welcome | Assign | ResultAck | HeartbeatAck | Cancel | Error, Field(discriminator="type")
]

_node_adapter: TypeAdapter[NodeMessage] = TypeAdapter(NodeMessage)
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)
NODE_TYPES = frozenset({"hello", "heartbeat", "status", "ready", "result", "results", "failure"})


class ProtocolError(ValueError):
    """A frame that is not a valid message; `code` and `message` go into an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_node_message(
    frame: str | bytes,
) -> Hello | Heartbeat | Status | Ready | Result | Results | Failure:
    """Parse one frame from a node, or raise ProtocolError with a readable reason."""
    import json

    try:
        raw = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: deeply nested arrays, which a hostile frame can hold.
        raise ProtocolError("malformed", f"frame is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", "a message must be a JSON object")
    kind = raw.get("type")
    # A non-string type (a list, say) is unhashable: test it before the set lookup.
    if not isinstance(kind, str) or kind not in NODE_TYPES:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r}; expected one of {sorted(NODE_TYPES)}"
        )
    if raw.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ProtocolError(
            "version",
            f"protocol version {raw.get('v')!r} not supported; this is {PROTOCOL_VERSION}",
        )
    try:
        return _node_adapter.validate_python(raw)
    except ValidationError as exc:
        raise ProtocolError("malformed", _describe(exc)) from None


def parse_server_message(
    frame: str | bytes,
) -> Welcome | Assign | ResultAck | HeartbeatAck | Cancel | Error:
    """Parse one frame from the coordinator (worker side)."""
    try:
        return _server_adapter.validate_json(frame)
    except ValidationError as exc:
        raise ProtocolError("malformed", _describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
