"""A member keeps its averager up until every member of its group has read its result
back: two real Hivemind DHT peers, each waiting for the other's mark."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import require_p2p

from idlegrid.p2p.averaging import settle

# Hivemind runs in this process here (elsewhere only in child processes): its imports of
# torch and importlib.resources warn of deprecations that are not idlegrid's.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def dhts() -> Iterator[tuple[Any, Any]]:
    require_p2p("the wait needs Hivemind's DHT")
    import hivemind

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          initial_peers=[str(a) for a in first.get_visible_maddrs()])  # fmt: skip
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def test_a_member_waits_for_the_slower_one_to_read_its_result(dhts: tuple[Any, Any]) -> None:
    first, second = dhts
    values = np.arange(5, dtype=np.float64)

    def slower() -> None:
        time.sleep(1.5)
        settle(second, "settle-a", [0, 1], 1, values, 10.0)

    helper = threading.Thread(target=slower)
    started = time.monotonic()
    helper.start()
    settle(first, "settle-a", [0, 1], 0, values, 10.0)
    waited = time.monotonic() - started
    helper.join()
    assert 1.5 <= waited < 8.0


def test_a_member_that_never_reads_back_holds_the_group_up_to_the_timeout(
    dhts: tuple[Any, Any],
) -> None:
    first, _ = dhts
    started = time.monotonic()
    settle(first, "settle-b", [0, 1], 0, np.zeros(3), 1.0)
    assert 1.0 <= time.monotonic() - started < 4.0
