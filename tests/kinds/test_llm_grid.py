"""llm-generate through a real grid: a coordinator on a loopback port, real worker daemons
(real WebSockets, HTTP blobs, llama.cpp in their task processes), the researcher SDK in
front, on the real SmolLM2 model."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from grids import serving
from helpers import eventually, record_failures
from llm_model import model_path

from idlegrid.client import Client
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker import hardware
from idlegrid.worker.daemon import Worker

KIND = "llm-generate"


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(URL, admin token) of a coordinator served in this process."""
    settings = CoordinatorSettings(
        data_dir=tmp_path / "coordinator",
        heartbeat_interval_s=0.2,
        # Every worker of these tests runs here, for one account: replicas on distinct nodes.
        distinct_accounts=False,
        distinct_networks=False,
    )
    async with serving(settings) as url:
        yield url, settings.admin_token_file.read_text()


async def _worker(client: Client, url: str, state: Path) -> Worker:
    token = (await asyncio.to_thread(client.create_token, kind="node"))["token"]
    worker = Worker(
        WorkerSettings(
            servers=(url,),
            token=token,
            state_dir=state,
            benchmark=False,
            dedicated=True,  # a test machine is never idle
            control_port=-1,  # no local control page
            kinds=(KIND,),
            threads=1,
        )
    )
    worker.hardware = HardwareProfile(
        memory_mb=hardware.memory_mb(),
        disk_free_mb=hardware.disk_free_mb(state),
        llama=hardware.llama_info(),
    )
    return worker


async def _wait(job: Any, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    async def there() -> dict[str, Any] | None:
        info = dict(await asyncio.to_thread(job.info))
        return info if done(info) else None

    return await eventually(there, "the job to get there", timeout_s=120, poll_s=0.1)


async def test_a_node_that_cannot_load_the_model_fails_and_others_make_the_shard(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    """The first node's copy of the model is damaged (as a full disk or a bad download
    leaves it): llama.cpp cannot load it, the node reports the failure, and the shard is
    made by another node and checked by two more (new checkers: a pass of one whose
    record no known-answer check has established yet needs a second)."""
    model = model_path()
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    broken = await _worker(client, url, tmp_path / "broken")
    # Where its task processes keep models (runtime.model_path): half the file.
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "broken" / "models").mkdir(parents=True)
    (tmp_path / "broken" / "models" / f"{digest}.gguf").write_bytes(
        model.read_bytes()[: model.stat().st_size // 2]
    )
    failures = record_failures(broken)
    runs = [asyncio.create_task(broken.run())]
    healthy: list[Worker] = []
    try:
        job = await asyncio.to_thread(
            client.generate, model, ["The capital of France is"], max_tokens=4, replication=2
        )

        async def failed_once() -> bool | None:
            return True if failures else None

        await eventually(failed_once, "the broken node to fail", timeout_s=120, poll_s=0.1)
        assert "cannot load the model" in failures[0], failures
        healthy = [await _worker(client, url, tmp_path / f"w{i}") for i in range(3)]
        runs += [asyncio.create_task(w.run()) for w in healthy]
        info = await _wait(job, lambda i: i["state"] not in ("queued", "running"))
        assert info["state"] == "completed", info
        [line] = await asyncio.to_thread(job.result)
        assert line["tokens"] and line["finish_reason"] in ("stop", "length")
        assert broken.completed == 0 and len(failures) == 1  # never given the shard again
        # The output and its two checks, and any known-answer checks beside them.
        assert sum(w.completed for w in healthy) >= 3
    finally:
        for worker in [broken, *healthy]:
            worker.stop()
        await asyncio.gather(*runs)
        client.close()
