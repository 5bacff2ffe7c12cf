"""The asynchronous mode on a virtual clock: a slow worker stalls synchronous rounds only."""

from __future__ import annotations

import diloco_simulate as simulate
import diloco_timeline as timeline
import pytest

from idlegrid.kinds.diloco.inner import InnerSettings
from idlegrid.training import models
from idlegrid.training.compression import Compression

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TINY = simulate.Setup(
    workers=3,
    rounds=6,
    corpus="pydoc-topics",
    model=models.LMConfig(vocab=103, context=16, width=16, layers=1, heads=2),
    inner=InnerSettings(steps=3, batch_size=4, seq_len=16, lr=3e-3),
    upload=Compression(method="int8"),
    download=Compression(method="int8"),
    eval_batches=1,
)


def test_a_slow_worker_sets_the_pace_of_synchronous_rounds_only() -> None:
    slow = {"slowdown": 3.0, "max_staleness": 3}
    synchronous = timeline.run(TINY, timeline.Conditions(**slow))
    asynchronous = timeline.run(TINY, timeline.Conditions(asynchronous=True, **slow))
    assert [round_ for _, round_, _, _ in synchronous.curve] == list(range(7))
    assert synchronous.curve[-1][0] == pytest.approx(18.0)  # six rounds of three task times
    assert asynchronous.curve[-1][0] == pytest.approx(6.0)  # quorum of the two fast ones
    # The slow worker's updates arrive 3 rounds late: applied, down-weighted.
    assert asynchronous.applied_stale >= 1 and asynchronous.dropped_stale == 0
    assert synchronous.applied_stale == 0
    assert asynchronous.curve[-1][2] < asynchronous.curve[0][2]


def test_updates_past_max_staleness_are_dropped_and_counted() -> None:
    conditions = timeline.Conditions(asynchronous=True, slowdown=3.0, max_staleness=1)
    outcome = timeline.run(TINY, conditions)
    assert outcome.applied_stale == 0 and outcome.dropped_stale >= 1


def test_churn_costs_synchronous_rounds_their_timer() -> None:
    churn = {"churn_every": 2, "churn_down": 1.5, "round_timeout": 4.0}
    synchronous = timeline.run(TINY, timeline.Conditions(**churn))
    asynchronous = timeline.run(TINY, timeline.Conditions(asynchronous=True, **churn))
    assert synchronous.curve[-1][0] > asynchronous.curve[-1][0] >= 6.0
