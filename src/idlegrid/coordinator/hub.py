"""Connected nodes of this coordinator process and how to send to them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel

from idlegrid import protocol
from idlegrid.policy.scheduler import GPU_BACKENDS, NodeView

log = logging.getLogger(__name__)

SendText = Callable[[str], Awaitable[None]]
# Blob hashes remembered per node for locality (most recent first out when over).
HELD_BLOBS_KEPT = 256


def node_view(
    node_id: int,
    kinds: Iterable[str],
    hardware: protocol.HardwareProfile,
    benchmark: protocol.Benchmark,
    *,
    account_id: int = 0,
) -> NodeView:
    """What the scheduler knows of a node, from what it said in its hello."""
    return NodeView(
        node_id=node_id,
        account_id=account_id,
        kinds=frozenset(kinds),
        backends=hardware.backends,
        memory_mb=hardware.memory_mb,
        gflops=benchmark.matmul_gflops,
        accelerator_memory_mb=max((gpu.memory_mb for gpu in hardware.gpus), default=0),
        disk_free_mb=hardware.disk_free_mb,
        onnx_providers=frozenset(hardware.onnx_providers),
        onnx_opset=hardware.onnx_opset,
        kind_rates=dict(benchmark.kind_rates),
    )


@dataclass
class NodeSession:
    """One live WebSocket connection of a node."""

    node_id: int
    account_id: int
    name: str
    slots: int
    view: NodeView
    kind_rates: dict[str, float]
    send_text: SendText
    close: Callable[[], Awaitable[None]]
    # Where it connects from (replicas of a shard go to distinct networks) and the
    # backend it computes on (trust is kept per kind and backend).
    network: str = ""
    backend: str = "cpu"
    # Its llama.cpp build as its hello said ("" without llama.cpp): checks of llm-generate
    # outputs go to nodes of the build the output's node reported.
    llama_build: str = ""
    prefetch: int = 0  # tasks it buffers beyond its slots
    # The minor version of the protocol its hello said: what it is sent, how it is read.
    protocol_minor: int = 0
    live: set[int] = field(default_factory=set)
    # No claims before this time (time.monotonic): its quota is used up or it is
    # suspended, so asking the store again at every new task would be wasted work.
    idle_until: float = 0.0
    # Its credibility (verification.trust) as of its last claim: the scheduler's reliability.
    reliability: float | None = None
    requested: int = 0
    # Of what it asked for, free GPU slots: tasks that need a GPU go only there (None:
    # an older worker that does not say; its hardware alone decides).
    gpu_free: int | None = None
    # The owner's machine is in use (the worker's `status`): its tasks are suspended.
    # Its reason, and whether it runs throttled, are in the store (`node_control`).
    paused: bool = False
    # Progress of running tasks by shard id (from heartbeats), and each task's shard.
    progress: dict[int, float] = field(default_factory=dict)
    shard_of: dict[int, int] = field(default_factory=dict)
    # The device each running task is on (from heartbeats), by task id.
    device_of: dict[int, str] = field(default_factory=dict)
    # FLOP/s per kind the coordinator measured of the node (its leases), read from the
    # store at time.monotonic() `measured_at` (leases.measure).
    measured_flops: dict[str, float] = field(default_factory=dict)
    measured_at: float = -math.inf
    # Blobs the node fetched from this coordinator or was handed as task input.
    held_blobs: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Its tasks since it connected: results accepted, and leases that ran out.
    tasks_returned: int = 0
    tasks_expired: int = 0
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fill_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Left the hub (disconnected, replaced, found silent, moved to another process):
    # nothing more is claimed for it (dispatch).
    closed: bool = False

    @property
    def wants(self) -> int:
        """Tasks to give now: what the node asked for, within its slots and buffer."""
        return max(0, min(self.requested, self.slots + self.prefetch - len(self.live)))

    @property
    def on_time(self) -> float:
        """Chance the node returns a task in time: (returned + 1) / (all + 2), 0.5 at first."""
        return (self.tasks_returned + 1) / (self.tasks_returned + self.tasks_expired + 2)

    def hold(self, blob_hash: str) -> None:
        """Remember that the node holds this blob (bounded: the oldest are forgotten)."""
        self.held_blobs[blob_hash] = None
        self.held_blobs.move_to_end(blob_hash)
        while len(self.held_blobs) > HELD_BLOBS_KEPT:
            self.held_blobs.popitem(last=False)

    def view_now(self, *, reliability: float) -> NodeView:
        """The node's view with what changes while it is connected: with no GPU slot
        free, a node without GPUs (tasks that need one wait for a GPU slot)."""
        view = self.view
        if self.gpu_free is not None and self.gpu_free < 1:
            view = dataclasses.replace(
                view, backends=view.backends - GPU_BACKENDS, accelerator_memory_mb=0
            )
        return dataclasses.replace(
            view,
            reliability=reliability,
            on_time=self.on_time,
            held_blobs=frozenset(self.held_blobs),
        )

    def forget_task(self, task_id: int) -> None:
        self.live.discard(task_id)
        self.device_of.pop(task_id, None)
        shard_id = self.shard_of.pop(task_id, None)
        if shard_id is not None:
            self.progress.pop(shard_id, None)

    async def send(self, message: BaseModel) -> bool:
        """Send one message; False when the connection is gone."""
        try:
            async with self.send_lock:
                await self.send_text(protocol.encode(message, peer_minor=self.protocol_minor))
            return True
        except Exception as exc:  # a dead socket raises many kinds of errors
            log.info("send to node %s failed: %s", self.node_id, exc)
            return False


class Hub:
    """Sessions by node id. One session per node: a new connection replaces the old."""

    def __init__(self) -> None:
        self._sessions: dict[int, NodeSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, node_id: int) -> NodeSession | None:
        return self._sessions.get(node_id)

    def sessions(self) -> list[NodeSession]:
        return list(self._sessions.values())

    def add(self, session: NodeSession) -> NodeSession | None:
        """Register a session; return the one it replaces, if any."""
        old = self._sessions.get(session.node_id)
        self._sessions[session.node_id] = session
        if old is not None and old is not session:
            old.closed = True
        return old

    def remove(self, session: NodeSession) -> bool:
        """Unregister `session` if it is still the node's current one."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
            session.closed = True
            return True
        return False

    async def cancel(self, node_id: int, task_id: int, reason: str) -> bool:
        """Tell a node connected to this process to drop a task; False if it is not here."""
        session = self._sessions.get(node_id)
        if session is None:
            return False
        session.forget_task(task_id)
        await session.send(protocol.Cancel(task_id=task_id, reason=reason))
        return True
