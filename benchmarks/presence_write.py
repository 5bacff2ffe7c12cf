"""How long the presence pass holds the coordinator's event loop, by chunk size.

    PYTHONPATH=src .venv/bin/python benchmarks/presence_write.py [--nodes 10000] [--chunk 500]

Registers `--nodes` nodes in a fresh SQLite store, then runs `store.nodes.touch_nodes` for
all of them three times (what the monitor's presence pass does every 10 s) while a
ticker on the same event loop measures how late it runs. `--chunk 0` writes all rows in
one statement (executemany), as before the chunks. Last line:
`chunk: C wall_s: W max_loop_lag_ms: L` (the worst of the three passes).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from idlegrid.store import nodes as store_nodes
from idlegrid.store.sql import SqlStore

TICK_S = 0.005


async def measure(nodes: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="idlegrid-presence-") as tmp:
        store = SqlStore(f"sqlite+idlegrid:///{Path(tmp) / 'idlegrid.db'}")
        await store.open()
        try:
            account = await store.accounts.create_account("fleet", is_admin=False, now=1.0)
            ids = []
            async with store.batch():
                for i in range(nodes):
                    node = await store.nodes.register_node(
                        account.id,
                        f"node-key-{i:06d}",
                        name="",
                        worker_version="",
                        hardware={},
                        benchmark={},
                        kinds=[],
                        slots=1,
                        address="",
                        now=1.0,
                    )
                    ids.append(node.id)
            lags: list[float] = []
            ticker = asyncio.create_task(_tick(lags))
            walls = []
            for round_no in range(3):
                started = time.perf_counter()
                await store.nodes.touch_nodes({node_id: 10.0 + round_no for node_id in ids})
                walls.append(time.perf_counter() - started)
            ticker.cancel()
            return max(walls), max(lags) * 1000
        finally:
            await store.close()


async def _tick(lags: list[float]) -> None:
    while True:
        before = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - before - TICK_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument(
        "--chunk", type=int, default=store_nodes.TOUCH_CHUNK, help="0: one statement"
    )
    args = parser.parse_args()
    store_nodes.TOUCH_CHUNK = args.chunk or args.nodes  # the module's setting, for this run
    wall, lag = asyncio.run(measure(args.nodes))
    print(f"chunk: {args.chunk} wall_s: {wall:.3f} max_loop_lag_ms: {lag:.0f}")


if __name__ == "__main__":
    main()
