"""A worker's standing averager: one process that keeps its DHT peer and its all-reduce
server across the rounds of a job, and across jobs while the worker holds p2p work.

The averager is a child of the task process (on Linux a fork of it, which finds torch
imported; elsewhere `python -m idlegrid.p2p.averaging PEERS MODE`: `launch`): it ends
with it, or after `IDLE_S` without a round. Its DHT peer and p2p daemon run in its own
event loop (`node`). The task process keeps one per DHT and reachability mode (`join`).
The first round of a job starts it when its task starts, so importing Hivemind and
joining the DHT overlap the member's training; later rounds find it up and pay for the
all-reduce only.

Each round, the member hands it its accumulator (its pseudo-gradient plus what error
feedback owes) and the job's upload compression, as a line on its stdin naming the
files; the averager answers with a line when the mean (or why not) is written. It runs
up to two attempts (`attempts`):

1. the whole group (every member named) under the round's key;
2. if that fails (a member died before or during the all-reduce, never came, or sent a
   part that does not decode), a retry under the key + "-retry" among the members
   left, if at least `min_size` of them, in the group the coordinator's bootstrap DHT
   peer names (`roster.gather`, `namer`).

Each attempt has the members meet in the DHT (each writes its peer id, addresses, mode
and whether it holds the outer state; `roster`), then all-reduce their parts compressed
as uploads are (`parts`, `allreduce`): every member reads back the same bytes of the
mean. A member in client mode (behind NAT) reduces no part; a group of client members
only cannot all-reduce, and says so (`ALL_CLIENTS`).

A standing averager that does not answer in time is killed and a new one started (the
round's result says so, and no round waits past its timeout); one that died between
rounds is replaced before the next round's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import select
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from idlegrid.p2p import attempts, launch, reachability
from idlegrid.p2p.attempts import ALL_CLIENTS  # noqa: F401 (the reason other modules name)
from idlegrid.p2p.group import Group
from idlegrid.training.compression import Compression
from idlegrid.training.flat import ContainerError, pack, unpack

FORMAT_IN = "idlegrid/p2p-average-in"
FORMAT_OUT = "idlegrid/p2p-average-out"
# Seconds a new averager may take to import torch and hivemind and join the DHT.
STARTUP_S = 60.0
# Seconds without a round after which a standing averager leaves (the worker no longer
# holds p2p work); the next round starts a new one.
IDLE_S = 900.0
MAX_MEMBERS = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Averaged:
    """What one member's averaging step came to."""

    # The group's mean (float32), or None: no group formed (see `reason`).
    values: np.ndarray | None
    # The members it averaged with (itself included): shard -> holds the outer state.
    members: dict[int, bool] = field(default_factory=dict)
    attempt: int = 0
    reason: str = ""
    # How this member took part: "public" (a full peer) or "client" (Hivemind's client mode).
    reachability: reachability.Mode = "public"
    # What the member's contributions missed of its accumulator (error feedback).
    residual: np.ndarray | None = None
    # Bytes this member sent and received in the all-reduce (every attempt), on the wire.
    wire_bytes: int = 0
    # Members the attempts could not do without (dead, unreachable, a bad part).
    blamed: tuple[int, ...] = ()


class Standing:
    """The parent's handle on one standing averager process."""

    def __init__(self, peers: tuple[str, ...], mode: reachability.Mode) -> None:
        self.peers, self.mode = peers, mode
        self._scratch = tempfile.TemporaryDirectory(prefix="idlegrid-p2p-")
        env = {**os.environ, "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "ERROR")}
        # Its log goes to a file: a pipe nobody reads while the member trains would fill.
        kept = os.environ.get("IDLEGRID_P2P_LOG_DIR")
        folder = Path(kept) if kept else Path(self._scratch.name)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"averager-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")  # noqa: SIM115
        self.started = time.monotonic()
        argv = [json.dumps(list(peers)), mode]
        if launch.forks():
            self.process: Any = launch.fork(main, argv, env, self._log)
        else:
            self.process = launch.spawn("idlegrid.p2p.averaging", argv, env, self._log)
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.rounds = 0

    def _read(self) -> None:
        assert self.process.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # closed by `close`
            for line in self.process.stdout:
                self._lines.put(line)
        self._lines.put("")  # the process closed its stdout: it is gone

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its answer line; TimeoutError or
        ConnectionError when the averager does not answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no answer in {timeout_s:.0f} s") from None
            if not line:
                raise ConnectionError(f"it exited ({self.process.poll()}): {self.tail()}")
            answer = json.loads(line)
            if answer.get("id") == request["id"]:
                return dict(answer)

    def tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return " | ".join(lines)[:500]

    def close(self) -> None:
        """End the process and its children (Hivemind's DHT process and p2p daemon, which
        outlive a killed parent) and remove its files."""
        import psutil

        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        # Its reader sees the end of stdout once the process and its children are gone;
        # closing the pipe under a reader that still reads would block.
        self._reader.join(timeout=2.0)
        pipes = [self.process.stdin] + ([] if self._reader.is_alive() else [self.process.stdout])
        for pipe in pipes:
            with contextlib.suppress(OSError, ValueError):
                if pipe is not None:
                    pipe.close()
        self._log.close()
        self._scratch.cleanup()


class Registry:
    """The standing averagers of one task process, per DHT and mode: a member takes one
    that no other member of this process holds (a worker's task process runs one task at
    a time, so it keeps one; tests run several members in one process)."""

    def __init__(self, start: Callable[[tuple[str, ...], reachability.Mode], Standing]) -> None:
        self._start = start
        self._idle: list[Standing] = []
        self._held: list[Standing] = []
        self._lock = threading.Lock()
        # Why earlier averagers were replaced, for the next round's record.
        self.replaced: list[str] = []

    def take(self, peers: tuple[str, ...], mode: reachability.Mode) -> Standing:
        """A running averager for this DHT and mode, started if none is free."""
        with self._lock:
            for standing in list(self._idle):
                if standing.peers != peers:  # another DHT: its jobs are over
                    self._idle.remove(standing)
                    standing.close()
                elif not standing.alive():
                    self._idle.remove(standing)
                    if standing.process.poll() != 0:  # 0: it left after IDLE_S, as meant
                        self.replaced.append(
                            f"the standing averager had exited ({standing.process.poll()}): "
                            f"{standing.tail()}"
                        )
                    standing.close()
            for standing in self._idle:
                if standing.mode == mode:
                    self._idle.remove(standing)
                    self._held.append(standing)
                    return standing
            started = self._start(peers, mode)
            self._held.append(started)
            return started

    def give_back(self, standing: Standing) -> None:
        with self._lock:
            if standing in self._held:
                self._held.remove(standing)
                self._idle.append(standing)

    def replace(self, standing: Standing, why: str) -> Standing:
        """Kill an averager that stopped answering and start another in its place (the
        caller's round reports `why`)."""
        log.warning("restarting the standing averager: %s", why)
        with self._lock:
            if standing in self._held:
                self._held.remove(standing)
            standing.close()
            started = self._start(standing.peers, standing.mode)
            self._held.append(started)
            return started

    def take_replaced(self) -> list[str]:
        with self._lock:
            taken, self.replaced = self.replaced, []
            return taken

    def close(self) -> None:
        with self._lock:
            for standing in self._idle + self._held:
                standing.close()
            self._idle, self._held = [], []


REGISTRY = Registry(Standing)


class Joining:
    """A member's handle on its standing averager for one round: `join` starts the
    averager (or finds it running) when the task starts; `average` hands it the vector."""

    def __init__(self, group: Group, *, shard: int, reachability_setting: str = "auto",
                 registry: Registry | None = None) -> None:  # fmt: skip
        self.group, self.shard = group, shard
        self.registry = registry or REGISTRY
        self.mode, why = reachability.choose(
            reachability_setting, group.peers, reachability.local_addresses()
        )
        log.info("peer-to-peer averaging of %s as a %s peer: %s", group.key, self.mode, why)
        self.standing = self.registry.take(group.peers, self.mode)
        self._done = False
        self._scratch = tempfile.TemporaryDirectory(prefix="idlegrid-p2p-round-")

    def average(self, values: np.ndarray, *, shard: int, holds_state: bool,
                settings: Compression | None = None) -> Averaged:  # fmt: skip
        """Average `values` (the accumulator) with the group, compressed as `settings`
        say (the job's upload; float32 when None). Never raises for a failed group: the
        reason says why."""
        settings = settings or Compression(method="none")
        notes: list[str] = self.registry.take_replaced()
        try:
            given = Path(self._scratch.name, "in.safetensors")
            taken = Path(self._scratch.name, "out.safetensors")
            header = {"format": FORMAT_IN, "shard": shard, "holds_state": holds_state,
                      "group": self.group.to_json(), "settings": settings.model_dump()}  # fmt: skip
            given.write_bytes(pack({"values": np.asarray(values, np.float32)}, header))
            request = {"id": f"{self.group.key}-{shard}", "in": str(given), "out": str(taken)}
            answer = self._ask(request, notes)
            if answer is None:
                return Averaged(None, reason="; ".join(notes), reachability=self.mode)
            if not taken.exists():
                why = f"the standing averager wrote no answer: {answer.get('error', '')}"
                return Averaged(None, reason="; ".join([*notes, why]), reachability=self.mode)
            done = _read_out(taken.read_bytes(), self.mode)
            if notes:
                reason = "; ".join([*notes, done.reason]) if done.reason else "; ".join(notes)
                done = Averaged(done.values, done.members, done.attempt, reason,
                                done.reachability, done.residual, done.wire_bytes,
                                done.blamed)  # fmt: skip
            return done
        finally:
            self._scratch.cleanup()

    def _ask(self, request: dict[str, Any], notes: list[str]) -> dict[str, Any] | None:
        """The averager's answer; a dead or silent averager is replaced (once, while
        the round has time): None when there is no answer in time."""
        budget = 2 * self.group.timeout_s + 10.0
        startup = max(0.0, STARTUP_S - (time.monotonic() - self.standing.started))
        deadline = time.monotonic() + budget + startup
        for tries in range(2):
            if not self.standing.alive():
                notes.append(
                    f"the standing averager had exited "
                    f"({self.standing.process.poll()}): {self.standing.tail()}"
                )
                self.standing = self.registry.replace(self.standing, notes[-1])
                # The new one has to start first: it gets the time a first round's has.
                deadline = max(deadline, time.monotonic() + budget + STARTUP_S)
            left = deadline - time.monotonic()
            if left <= 1.0:
                break
            try:
                return self.standing.ask(request, left)
            except (TimeoutError, ConnectionError, OSError, ValueError) as exc:
                why = f"the standing averager did not answer: {exc}"
                notes.append(why)
                self.standing = self.registry.replace(self.standing, why)
                if tries == 0 and isinstance(exc, TimeoutError):
                    break  # the round's time is spent
        return None

    def close(self) -> None:
        """The round is over for this member: the averager stands on, free for its next."""
        self._scratch.cleanup()
        if not self._done:
            self._done = True
            self.registry.give_back(self.standing)


def join(group: Group, *, shard: int, reachability_setting: str = "auto") -> Joining:
    """Shard `shard`'s handle on its standing averager for `group` (see `Joining`), as a
    full peer or in client mode (`reachability.choose`)."""
    return Joining(group, shard=shard, reachability_setting=reachability_setting)


def _read_out(blob: bytes, asked: reachability.Mode) -> Averaged:
    """The averager's answer; `asked`: the mode it was started in."""
    try:
        arrays, header = unpack(blob)
        if header.get("format") != FORMAT_OUT:
            raise ContainerError(f"not a {FORMAT_OUT} container")
        members = {int(shard): bool(full) for shard, full in header["members"]}
        ran: reachability.Mode = (
            "client" if header.get("reachability", asked) == "client" else "public"
        )
        return Averaged(arrays.get("values"), members, int(header["attempt"]),
                        str(header["reason"]), ran, arrays.get("residual"),
                        int(header.get("wire_bytes", 0)),
                        tuple(int(b) for b in header.get("blamed", ())))  # fmt: skip
    except (ContainerError, KeyError, TypeError, ValueError) as exc:
        return Averaged(None, reason=f"unreadable averaging output: {exc}", reachability=asked)


# -- the averager process ------------------------------------------------------------------


def _exit_with_parent() -> None:
    """An averager whose task process died (the worker ended) leaves at once."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        _leave(3)

    threading.Thread(target=watch, daemon=True).start()


def _leave(code: int) -> NoReturn:
    """Exit now, with the p2p daemon (a child, which an exit that skips its shutdown
    would leave running)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    sys.stdout.flush()
    os._exit(code)


class Server:
    """The averager process's state: its event loop (in a thread), its DHT peer and p2p
    daemon in that loop (`node.LocalDHT`), and its all-reduce server."""

    def __init__(self, peers: list[str], mode: str) -> None:
        from idlegrid.p2p import allreduce
        from idlegrid.p2p.node import LocalDHT

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.dht = LocalDHT.join(self.loop, peers, mode)
        self.mode = "client" if self.dht.client_mode else "public"
        self.reducer = allreduce.Reducer()
        self.p2p = self.dht.p2p
        if self.mode == "public":
            self.run(self.p2p.add_binary_stream_handler(allreduce.HANDLER, self.reducer.serve))

    def run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


def _serve_requests(server: Server | None, failed: str) -> None:
    """Answer each request line (one round) until stdin closes or `IDLE_S` passes."""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_S)
        if not ready:
            return  # no p2p work for a while
        line = sys.stdin.readline()
        if not line:
            return
        request = json.loads(line)
        arrays, header = unpack(Path(request["in"]).read_bytes())
        if header.get("format") != FORMAT_IN:
            raise ContainerError(f"not a {FORMAT_IN} container")
        group = Group.from_json(header["group"])
        settings = Compression.model_validate(header["settings"])
        # Said in its log: an operator (or a test) sees which round it is averaging.
        print(f"averaging {group.key} as member {header['shard']}", file=sys.stderr, flush=True)
        if server is None:
            outcome = attempts.Outcome(None, {}, 0, failed)
        else:
            try:
                outcome = attempts.attempt_all(
                    server, arrays["values"], group, int(header["shard"]),
                    bool(header["holds_state"]), settings,
                )  # fmt: skip
            except Exception as exc:  # a bug must cost one round, not the averager
                log.exception("averaging %s failed", group.key)
                outcome = attempts.Outcome(None, {}, 0, f"{type(exc).__name__}: {exc}"[:300])
        out = {} if outcome.mean is None else {"values": outcome.mean}
        if outcome.residual is not None:
            out["residual"] = outcome.residual
        meta = {"format": FORMAT_OUT, "members": sorted(outcome.members.items()),
                "attempt": outcome.attempt, "reason": outcome.reason,
                "wire_bytes": outcome.wire_bytes, "blamed": sorted(outcome.blamed)}  # fmt: skip
        if server is not None:
            meta["reachability"] = server.mode
        Path(request["out"]).write_bytes(pack(out, meta))
        print(
            f"averaged {group.key}: attempt {outcome.attempt}, {outcome.wire_bytes} bytes"
            + (f", {outcome.reason}" if outcome.reason else ""),
            file=sys.stderr,
            flush=True,
        )
        print(json.dumps({"id": request["id"]}), flush=True)


def main(argv: list[str]) -> int:
    """The averager: join the DHT now, then average each round it is handed."""
    peers, mode = json.loads(argv[0]), reachability.check(argv[1])
    launch.name_this_process()
    _exit_with_parent()
    server, failed = None, ""
    try:
        server = Server(peers, mode)
    except Exception as exc:  # the p2p daemon, the DHT bootstrap: many kinds of errors
        failed = f"the p2p daemon did not start: {type(exc).__name__}: {exc}"[:300]
        print(failed, file=sys.stderr, flush=True)
    _serve_requests(server, failed)
    # Hivemind's shutdown waits for its processes: end them and leave.
    _leave(0)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
