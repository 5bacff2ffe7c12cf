"""The coordinator's garbage-collector keeper (coordinator/heap.py)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest
from helpers import eventually

from idlegrid.coordinator.heap import NO_AUTOMATIC_FULL_PASS, HeapKeeper


class Node:
    """Something that sits in a reference cycle, as connection objects do."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_freeze_moves_survivors_out_of_the_collectors_passes() -> None:
    keeper = HeapKeeper(freeze_every_s=1.0, full_every_s=10.0)
    survivor = Node()
    keeper.freeze()
    assert gc.get_freeze_count() > 0
    # A frozen object is not walked by later passes: its cycle outlives a full collection.
    ref = weakref.ref(survivor)
    del survivor
    gc.collect()
    assert ref() is not None


def test_a_full_pass_frees_cycles_among_frozen_objects_and_freezes_again() -> None:
    keeper = HeapKeeper(freeze_every_s=1.0, full_every_s=10.0)
    garbage = Node()
    ref = weakref.ref(garbage)
    keeper.freeze()
    del garbage
    began = time.perf_counter()
    took = keeper.full()
    elapsed = time.perf_counter() - began
    assert ref() is None
    # The seconds of the pass itself: some, and no more than the call took.
    assert 0 < took <= elapsed and keeper.full_passes == 1
    assert gc.get_freeze_count() > 0


def test_step_runs_the_full_pass_when_it_is_due() -> None:
    keeper = HeapKeeper(freeze_every_s=1.0, full_every_s=10.0)
    keeper.step()
    assert keeper.full_passes == 0
    keeper.last_full -= 11.0
    keeper.step()
    assert keeper.full_passes == 1


def test_run_unfreezes_when_stopped() -> None:
    keeper = HeapKeeper(young_every_s=0.01, freeze_every_s=0.01, full_every_s=0.05)

    async def main() -> None:
        stopping = asyncio.Event()
        task = asyncio.create_task(keeper.run(stopping))
        await eventually(
            lambda: gc.get_freeze_count() > 0 and keeper.full_passes >= 1, "a freeze, a full pass"
        )
        assert gc.get_freeze_count() > 0
        stopping.set()
        await task

    asyncio.run(main())
    assert gc.get_freeze_count() == 0
    assert keeper.full_passes >= 1


def test_run_owns_the_full_passes_while_it_runs() -> None:
    keeper = HeapKeeper(young_every_s=0.01, freeze_every_s=0.01, full_every_s=10.0)
    before = gc.get_threshold()

    async def main() -> None:
        stopping = asyncio.Event()
        task = asyncio.create_task(keeper.run(stopping))
        await eventually(lambda: gc.get_threshold()[2] == NO_AUTOMATIC_FULL_PASS, "the keeper")
        young, middle, full = gc.get_threshold()
        # The young passes run as before; no automatic full pass comes between the
        # keeper's own.
        assert (young, middle) == before[:2]
        assert full == NO_AUTOMATIC_FULL_PASS
        stopping.set()
        await task

    asyncio.run(main())
    assert gc.get_threshold() == before


def test_between_freezes_a_tick_is_a_young_pass_that_freezes_nothing() -> None:
    keeper = HeapKeeper(young_every_s=1.0, freeze_every_s=30.0, full_every_s=3600.0)
    keeper.freeze()
    frozen = gc.get_freeze_count()
    survivor = Node()
    keeper.step()  # a young pass: the survivor moves to generation 2, not frozen
    assert gc.get_freeze_count() == frozen
    assert any(obj is survivor for obj in gc.get_objects(generation=2))
    keeper.last_freeze -= 31.0
    keeper.step()  # the freeze is due
    assert gc.get_freeze_count() > frozen
    assert keeper.full_passes == 0


@pytest.mark.parametrize(
    ("young", "freeze", "full"), [(1.0, 0.0, 10.0), (1.0, 10.0, 5.0), (0.0, 1.0, 10.0),
                                  (2.0, 1.0, 10.0)]
)  # fmt: skip
def test_settings_are_checked(young: float, freeze: float, full: float) -> None:
    with pytest.raises(ValueError):
        HeapKeeper(young_every_s=young, freeze_every_s=freeze, full_every_s=full)
