"""A worker's standing averager (p2p/averaging.py): kept across rounds, replaced when it
exited or stopped answering, and no round waits past its timeout for it. The processes
are stand-ins here; real ones: tests/training/test_training_p2p.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from idlegrid.p2p import averaging
from idlegrid.p2p.group import Group
from idlegrid.training.flat import pack

GROUP = Group("standing-test", (0, 1), min_size=2, timeout_s=5.0,
              peers=("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWtest",))  # fmt: skip


class Exited:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class FakeStanding:
    """An averager that answers (writes the mean it was given, halved), dies mid-round,
    stays silent, or has exited before the round."""

    made: list[FakeStanding] = []

    def __init__(self, peers: tuple[str, ...], mode: str, behaviour: str) -> None:
        self.peers, self.mode, self.behaviour = peers, mode, behaviour
        self.started = 0.0  # long ago: no start-up time left to add
        self.process = Exited(None if behaviour != "exited" else 1)
        self.asked: list[float] = []
        self.closed = False

    def alive(self) -> bool:
        return self.process.poll() is None and not self.closed

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.asked.append(timeout_s)
        if self.behaviour == "dies":
            self.process.code = -9
            raise ConnectionError("it exited (-9)")
        if self.behaviour == "silent":
            raise TimeoutError(f"no answer in {timeout_s:.0f} s")
        meta = {"format": averaging.FORMAT_OUT, "members": [[0, True], [1, True]],
                "attempt": 1, "reason": "", "wire_bytes": 123}  # fmt: skip
        Path(request["out"]).write_bytes(pack({"values": np.full(4, 0.5, np.float32)}, meta))
        return {"id": request["id"]}

    def tail(self) -> str:
        return "its last words"

    def close(self) -> None:
        self.closed = True


def registry(*behaviours: str) -> averaging.Registry:
    queue = list(behaviours)

    def start(peers: tuple[str, ...], mode: Any) -> Any:
        made = FakeStanding(peers, mode, queue.pop(0))
        FakeStanding.made.append(made)
        return made

    FakeStanding.made = []
    return averaging.Registry(start)


def average(reg: averaging.Registry) -> averaging.Averaged:
    joining = averaging.Joining(GROUP, shard=0, reachability_setting="public", registry=reg)
    try:
        return joining.average(np.ones(4, np.float32), shard=0, holds_state=True)
    finally:
        joining.close()


def test_one_averager_stands_across_rounds() -> None:
    reg = registry("answers")
    first, second = average(reg), average(reg)
    assert first.values is not None and second.values is not None and first.wire_bytes == 123
    assert len(FakeStanding.made) == 1 and len(FakeStanding.made[0].asked) == 2


def test_an_averager_that_died_mid_round_is_replaced_without_losing_the_round() -> None:
    reg = registry("dies", "answers")
    done = average(reg)
    assert done.values is not None, done.reason
    assert "did not answer: it exited (-9)" in done.reason
    assert [m.closed for m in FakeStanding.made] == [True, False]
    assert average(reg).reason == ""  # the next round: the replacement, and nothing to say


def test_an_averager_that_exited_between_rounds_is_replaced_and_reported() -> None:
    reg = registry("answers", "answers")
    average(reg)
    FakeStanding.made[0].process.code = 1
    done = average(reg)
    assert done.values is not None
    assert "had exited (1): its last words" in done.reason
    assert len(FakeStanding.made) == 2


def test_a_silent_averager_is_restarted_and_the_round_waits_no_longer_than_its_timeout() -> None:
    reg = registry("silent", "answers")
    done = average(reg)
    assert done.values is None and "did not answer: no answer in" in done.reason
    # It waited at most the round's averaging time (two attempts of the group's timeout).
    assert FakeStanding.made[0].asked == [pytest.approx(2 * GROUP.timeout_s + 10, abs=1)]
    assert FakeStanding.made[0].closed and not FakeStanding.made[1].closed
    assert average(reg).values is not None  # the replacement serves the next round


def test_members_of_one_process_get_averagers_of_their_own() -> None:
    reg = registry("answers", "answers")
    one = averaging.Joining(GROUP, shard=0, reachability_setting="public", registry=reg)
    two = averaging.Joining(GROUP, shard=1, reachability_setting="public", registry=reg)
    assert one.standing is not two.standing
    one.close()
    two.close()
    three = averaging.Joining(GROUP, shard=0, reachability_setting="public", registry=reg)
    assert three.standing in (one.standing, two.standing)
    three.close()


def test_an_averager_that_left_idle_is_started_again_without_a_word() -> None:
    reg = registry("answers", "answers")
    average(reg)
    FakeStanding.made[0].process.code = 0  # it left after IDLE_S without a round
    done = average(reg)
    assert done.values is not None and done.reason == "" and len(FakeStanding.made) == 2
