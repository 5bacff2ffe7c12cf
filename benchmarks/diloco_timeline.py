"""DiLoCo rounds on a virtual clock: synchronous or asynchronous, slow or churning workers.

The round driver's two modes, played in one process with real training (`runner.run_task`)
and the real round closing (`closing.close_round`), on a clock measured in task times (a
normal worker needs 1.0 to train one round's H steps):

- synchronous: a round closes when every worker's update is in, or on its timer with
  what arrived; an update from an older round is dropped.
- asynchronous: a round closes on its quorum (`min_updates`) or its timer; a worker still
  training an older round finishes it, and its update counts in the round open when it
  arrives, weighted (1 + s)^-alpha by its staleness s, up to `max_staleness` (older ones
  are dropped, counted).

Each worker owns one shard (as the driver's affinity has it). `slow` makes one worker
take `slowdown` times as long; `churn_every` kills one worker (in turn) every so many
rounds: its task in flight is lost, and it comes back `churn_down` later with nothing
cached (its weights and AdamW moments gone).

Run: ``PYTHONPATH=src python benchmarks/diloco_timeline.py --rounds 30 --slowdown 3`` (flags
as `diloco_simulate.py`, plus these). It prints each mode's wall time to the target loss and
its final test loss.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import diloco_simulate as simulate

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.run import run_task
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import closing, models, schedule
from idlegrid.training.compression import decode


@dataclass(frozen=True)
class Conditions:
    """How the workers behave and how rounds close."""

    asynchronous: bool = False
    min_updates: int | None = None  # default: every worker (synchronous), all but one (async)
    max_staleness: int = 2
    round_timeout: float = 4.0  # in task times
    slowdown: float = 1.0  # the last worker takes this many task times a task
    churn_every: int = 0  # rounds between kills (0: none)
    churn_down: float = 1.5  # task times a killed worker stays away


@dataclass
class Outcome:
    """One run on the virtual clock."""

    mode: str
    curve: list[tuple[float, int, float, float]] = field(default_factory=list)  # t, round, v, test
    applied_stale: int = 0
    dropped_stale: int = 0
    lost_to_churn: int = 0

    def time_to(self, loss: float) -> float | None:
        """Virtual time at which the validation loss first reached `loss`."""
        return next((t for t, _, v, _ in self.curve if v <= loss), None)


@dataclass(order=True)
class _Event:
    time: float
    order: int
    kind: str = field(compare=False)  # "done" (a task finished) or "back" (a restart)
    worker: int = field(compare=False)
    update: closing.Update | None = field(compare=False, default=None)
    epoch: int = field(compare=False, default=0)


def run(setup: simulate.Setup, conditions: Conditions) -> Outcome:
    """The rounds of `setup` under `conditions`; a checkpoint evaluated at every close."""
    return _Timeline(setup, conditions).play()


class _Timeline:
    def __init__(self, setup: simulate.Setup, conditions: Conditions) -> None:
        self.setup, self.conditions = setup, conditions
        weights = models.init_weights(simulate.ARCHITECTURE, setup.model, setup.seed)
        self.state = closing.initial_state(weights)
        self.history = {0: self.state}
        self.nodes = [WorkerState() for _ in range(setup.workers)]
        self.busy = [False] * setup.workers
        self.alive = [True] * setup.workers
        self.epoch = [0] * setup.workers  # a kill makes the task in flight stale
        self.trained = [-1] * setup.workers  # the last round each worker started
        self.train = tasks.CorpusSlice(
            "train", 0, len(corpus.train_tokens(setup.corpus)), setup.corpus
        )
        self.events: list[_Event] = []
        self.order = 0
        self.now = 0.0
        self.opened = 0.0
        self.arrived: list[closing.Update] = []
        mode = "asynchronous" if conditions.asynchronous else "synchronous"
        self.outcome = Outcome(mode)
        self.kills = 0

    @property
    def quorum(self) -> int:
        if self.conditions.min_updates is not None:
            return self.conditions.min_updates
        return self.setup.workers - (1 if self.conditions.asynchronous else 0)

    def play(self) -> Outcome:
        self._record()
        self._start_idle()
        while self.state.round < self.setup.rounds:
            deadline = self.opened + self.conditions.round_timeout
            timer_expired = not self.events or self.events[0].time > deadline
            if timer_expired:
                self.now = deadline
            else:
                event = heapq.heappop(self.events)
                self.now = event.time
                if event.kind == "back":
                    self.alive[event.worker] = True
                    self.nodes[event.worker] = WorkerState()
                elif event.epoch == self.epoch[event.worker]:
                    self.busy[event.worker] = False
                    self._arrive(event.update)
            # The driver's rule (`schedule.close_decision`), on this clock.
            fresh = len(self._fresh())
            decision = schedule.close_decision(
                updates=fresh,
                min_updates=self.quorum,
                timer_expired=timer_expired,
                late=len(self.arrived) - fresh,
            )
            if decision is schedule.Close.EXTEND:
                self.opened = self.now  # nothing to aggregate: the timer starts again
            elif decision is not schedule.Close.WAIT:
                self._close()
            if not timer_expired:
                self._start_idle()
        return self.outcome

    def _fresh(self) -> list[closing.Update]:
        return [u for u in self.arrived if u.base_round == self.state.round]

    def _arrive(self, update: closing.Update | None) -> None:
        assert update is not None
        staleness = self.state.round - update.base_round
        allowed = self.conditions.max_staleness if self.conditions.asynchronous else 0
        if staleness > allowed:
            self.outcome.dropped_stale += 1
        else:
            self.outcome.applied_stale += staleness > 0
            self.arrived.append(update)

    def _close(self) -> None:
        closed = closing.close_round(
            self.state, self.arrived, rule=self.setup.aggregation, outer=self.setup.outer,
            download=self.setup.download, asynchronous=self.conditions.asynchronous,
            max_staleness=self.conditions.max_staleness,
        )  # fmt: skip
        self.state = closed.state
        self.history[self.state.round] = self.state
        self.history.pop(self.state.round - self.conditions.max_staleness - 2, None)
        self.arrived = []
        self.opened = self.now
        if not self.conditions.asynchronous:
            # The synchronous driver cancels the closed round's tasks still running.
            for worker in range(self.setup.workers):
                if self.busy[worker]:
                    self.busy[worker] = False
                    self.epoch[worker] += 1
        self._churn()
        self._record()

    def _churn(self) -> None:
        every = self.conditions.churn_every
        if not every or self.state.round % every or self.state.round >= self.setup.rounds:
            return
        victim = self.kills % self.setup.workers
        self.kills += 1
        if self.busy[victim]:
            self.outcome.lost_to_churn += 1
        self.busy[victim], self.alive[victim] = False, False
        self.trained[victim] = -1  # its task is lost: back, it trains the round then open
        self.epoch[victim] += 1
        self._push(self.now + self.conditions.churn_down, "back", victim)

    def _record(self) -> None:
        validation = simulate.evaluate(self.setup, self.state.weights, "validation")
        test = simulate.evaluate(self.setup, self.state.weights, "test")
        self.outcome.curve.append((self.now, self.state.round, validation, test))

    def _start_idle(self) -> None:
        if self.state.round >= self.setup.rounds:
            return
        for worker in range(self.setup.workers):
            if self.busy[worker] or not self.alive[worker]:
                continue
            if self.trained[worker] >= self.state.round:
                continue  # its update for this round is in (or lost): wait for the next
            self.trained[worker] = self.state.round
            self.busy[worker] = True
            update = self._train(worker)
            slow = worker == self.setup.workers - 1
            took = self.conditions.slowdown if slow else 1.0
            self._push(self.now + took, "done", worker, update)

    def _train(self, worker: int) -> closing.Update:
        state = self.state
        task = tasks.TaskPayload(
            mode="train", stream="timeline", round=state.round, shard=worker,
            seed=closing.task_seed(self.setup.seed, state.round, worker),
            target=tasks.WeightsRef(state.round, state.digest),
            data=tasks.shard_ref(self.train, worker, self.setup.workers), weights=state.weights,
        )  # fmt: skip
        result = run_task(task, self.setup.spec(), self.nodes[worker], device=self.setup.device)
        assert result.update is not None
        return closing.Update(decode(result.update), result.round, result.loss_mean)

    def _push(
        self, time: float, kind: str, worker: int, update: closing.Update | None = None
    ) -> None:
        self.order += 1
        event = _Event(time, self.order, kind, worker, update, self.epoch[worker])
        heapq.heappush(self.events, event)


# -- command line -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--churn-every", type=int, default=0)
    parser.add_argument("--churn-down", type=float, default=1.5)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--round-timeout", type=float, default=4.0)
    parser.add_argument("--modes", nargs="+", default=["synchronous", "asynchronous"])
    own, rest = parser.parse_known_args(argv)
    args = simulate.parse_args(rest)
    from idlegrid.kinds.diloco.inner import use_threads

    use_threads(args.threads)
    rows = []
    for seed in args.seeds:
        setup = simulate.setup_from(args, seed)
        outcomes = {
            mode: run(setup, Conditions(
                asynchronous=mode == "asynchronous", max_staleness=own.max_staleness,
                round_timeout=own.round_timeout, slowdown=own.slowdown,
                churn_every=own.churn_every, churn_down=own.churn_down,
            ))
            for mode in own.modes
        }  # fmt: skip
        target = max(o.curve[-1][2] for o in outcomes.values())
        for mode, outcome in outcomes.items():
            end = outcome.curve[-1]
            reached = outcome.time_to(target)
            rows.append({"seed": seed, "mode": mode, "time_to_target": reached,
                         "target": target, "final_time": end[0], "final_test": end[3],
                         "applied_stale": outcome.applied_stale,
                         "dropped_stale": outcome.dropped_stale,
                         "lost_to_churn": outcome.lost_to_churn,
                         "curve": outcome.curve})  # fmt: skip
            print(f"seed {seed} {mode}: validation {target:.4f} reached at t="
                  f"{reached if reached is None else round(reached, 2)}, {setup.rounds} rounds "
                  f"done at t={end[0]:.2f}, final test {end[3]:.4f}, stale updates applied "
                  f"{outcome.applied_stale}, dropped {outcome.dropped_stale}, "
                  f"lost to churn {outcome.lost_to_churn}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
