"""onnx-infer through a real grid: a coordinator on a loopback port, real worker daemons
(real WebSockets, HTTP blobs, ONNX Runtime), the researcher SDK in front."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from grids import serving
from helpers import eventually, record_failures

from idlegrid.client import Client, IdlegridError
from idlegrid.kinds.onnx.data import Preprocess, decode_batch, load_images, zip_files
from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, images, mlp
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker import hardware
from idlegrid.worker.daemon import Worker


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


def _profile() -> HardwareProfile:
    return HardwareProfile(
        memory_mb=hardware.memory_mb(),
        onnx_providers=hardware.onnx_providers(),
        onnx_opset=hardware.onnx_opset(),
    )


async def _worker(client: Client, url: str, state: Path, **settings: Any) -> Worker:
    token = (await asyncio.to_thread(client.create_token, kind="node"))["token"]
    worker = Worker(
        WorkerSettings(
            servers=(url,),
            token=token,
            state_dir=state,
            benchmark=False,
            dedicated=True,  # a test machine is never idle
            control_port=-1,  # no local control page
            **settings,
        )
    )
    worker.hardware = _profile() if "onnx-infer" in worker.kinds else HardwareProfile()
    return worker


async def _wait(job: Any, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The job's info once `done` says so (within a minute)."""

    async def there() -> dict[str, Any] | None:
        info = dict(await asyncio.to_thread(job.info))
        return info if done(info) else None

    return await eventually(there, "the job to get there", timeout_s=60, poll_s=0.05)


def _ended(info: dict[str, Any]) -> bool:
    return info["state"] not in ("queued", "running")


async def test_images_and_arrays_run_on_two_workers_and_match_a_local_run(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    workers = [
        await _worker(client, url, tmp_path / f"w{i}", kinds=("onnx-infer",), threads=1)
        for i in range(2)
    ]
    runs = [asyncio.create_task(w.run()) for w in workers]
    try:
        folder = tmp_path / "pictures"
        folder.mkdir()
        paths = []
        for index, blob in enumerate(images(9, seed=2)):
            paths.append(folder / f"img{8 - index}.png")  # name order is not list order
            paths[-1].write_bytes(blob)
        model = conv_net()
        job = await asyncio.to_thread(
            client.submit_images,
            model,
            paths,
            preprocess=IMAGENET_PREPROCESS,
            shard_size=2,
            replication=2,
        )
        info = await _wait(job, _ended)
        assert info["state"] == "completed", info
        result = await asyncio.to_thread(job.result)
        spec = Preprocess.model_validate(IMAGENET_PREPROCESS)
        batch = decode_batch(load_images(zip_files(paths)), spec, "float32")
        reference = ort.InferenceSession(model).run(None, {"image": batch})
        np.testing.assert_allclose(result["logits"], reference[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result["label"], reference[2])
        assert sum(w.completed for w in workers) == 10  # 5 shards x 2 replicas, both nodes
        assert all(w.completed for w in workers)

        rows = np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32)
        arrays = await asyncio.to_thread(
            client.submit_onnx, mlp(), {"x": rows}, batch_size=8, shard_size=16, replication=1
        )
        assert (await _wait(arrays, _ended))["state"] == "completed"
        y = (await asyncio.to_thread(arrays.result))["y"]
        np.testing.assert_allclose(y, ort.InferenceSession(mlp()).run(None, {"x": rows})[0])
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*runs)
        client.close()


async def test_bad_submissions_get_a_422_that_names_the_problem(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    rows = {"x": np.zeros((4, 32), np.float32)}
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    cases = [
        (lambda: client.submit_onnx(b"no model here", rows), "not an ONNX file"),
        (lambda: client.submit_onnx(mlp(), {"features": rows["x"]}), "do not match the model"),
        (
            lambda: client.submit_images(conv_net(), [bad], preprocess=IMAGENET_PREPROCESS),
            "_bad.png' cannot be decoded",
        ),
        (lambda: client.submit_images(conv_net(), [bad], preprocess={}), "crop"),
    ]
    try:
        for submit, message in cases:
            with pytest.raises(IdlegridError) as caught:
                await asyncio.to_thread(submit)
            assert caught.value.status == 422 and message in caught.value.message
        jobs = await asyncio.to_thread(client.jobs)
        assert jobs == []  # nothing reached the queue
    finally:
        client.close()


async def test_a_node_without_onnx_runtime_never_gets_the_kind(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    plain = await _worker(client, url, tmp_path / "plain", kinds=("noop",))
    running = asyncio.create_task(plain.run())
    try:
        rows = {"x": np.zeros((4, 32), np.float32)}
        job = await asyncio.to_thread(client.submit_onnx, mlp(), rows, replication=1)
        info = await _wait(job, lambda i: bool(i["waiting_for"]))
        assert "does not offer kind onnx-infer" in info["waiting_for"][0], info
        await asyncio.sleep(0.5)  # time to prove the job stays queued: a wait would not end
        assert (await asyncio.to_thread(job.info))["state"] == "queued"
        assert plain.completed == 0
    finally:
        plain.stop()
        await running
        client.close()


async def test_a_provider_failing_mid_shard_sends_the_shard_to_other_nodes(
    coordinator: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker with 3 threads has a provider that breaks after its first batch (a fault
    # point its task processes read from the environment); the others compute.
    monkeypatch.setenv("IDLEGRID_FAULTS", "onnx-after-first-batch-threads-3")
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    broken = await _worker(client, url, tmp_path / "broken", kinds=("onnx-infer",), threads=3)
    failures = record_failures(broken)
    runs = [asyncio.create_task(broken.run())]
    healthy: list[Worker] = []
    try:
        rows = np.random.default_rng(1).standard_normal((12, 32)).astype(np.float32)
        # Replicated, so the store keeps the failed node off the shard's later tasks.
        job = await asyncio.to_thread(
            client.submit_onnx, mlp(), rows, batch_size=4, shard_size=12, replication=2
        )
        await _wait(job, lambda i: bool(failures) or _ended(i))
        for name in ("ok1", "ok2"):
            healthy.append(
                await _worker(client, url, tmp_path / name, kinds=("onnx-infer",), threads=1)
            )
            runs.append(asyncio.create_task(healthy[-1].run()))
        info = await _wait(job, _ended)
        assert info["state"] == "completed", info
        y = (await asyncio.to_thread(job.result))["y"]
        np.testing.assert_allclose(y, ort.InferenceSession(mlp()).run(None, {"x": rows})[0])
        assert len(failures) == 1 and "illegal memory access" in failures[0], failures
        assert broken.completed == 0
        assert [w.completed for w in healthy] == [1, 1]
    finally:
        for worker in (broken, *healthy):
            worker.stop()
        await asyncio.gather(*runs)
        client.close()


async def test_waiting_for_names_the_provider_no_node_has(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    cpu_only = await _worker(client, url, tmp_path / "cpu", kinds=("onnx-infer",))
    running = asyncio.create_task(cpu_only.run())
    try:
        rows = {"x": np.zeros((4, 32), np.float32)}
        job = await asyncio.to_thread(
            client.submit_onnx, mlp(), rows, providers=["CUDAExecutionProvider"], replication=1
        )
        info = await _wait(job, lambda i: bool(i["waiting_for"]))
        assert "has no ONNX execution provider of CUDAExecutionProvider" in info["waiting_for"][0]
        assert cpu_only.completed == 0
    finally:
        cpu_only.stop()
        await running
        client.close()


@pytest.mark.slow
async def test_a_real_transformer_runs_as_onnx_infer(
    coordinator: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """all-MiniLM-L6-v2, exported from the packaged weights, as a researcher's model:
    token arrays in, hidden states out, mean-pooled here and checked against
    sentence-transformers."""
    from idlegrid.kinds.embed_text import onnx as embed_onnx
    from idlegrid.kinds.embed_text.kind import embed_reference, row_cosines
    from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

    monkeypatch.setenv("IDLEGRID_ONNX_CACHE", str(tmp_path / "cache"))
    model = embed_onnx.exported_model().read_bytes()
    texts = stdlib_paragraphs(24)
    encoded = embed_onnx.tokenizer().encode_batch(texts)  # one length for the whole set
    fields = (
        ("input_ids", "ids"),
        ("attention_mask", "attention_mask"),
        ("token_type_ids", "type_ids"),
    )
    arrays = {
        name: np.array([getattr(e, attr) for e in encoded], dtype=np.int64) for name, attr in fields
    }
    url, admin = coordinator
    client = Client(url, token=admin.strip())
    worker = await _worker(client, url, tmp_path / "w", kinds=("onnx-infer",), threads=2)
    running = asyncio.create_task(worker.run())
    try:
        job = await asyncio.to_thread(
            client.submit_onnx, model, arrays, shard_size=8, batch_size=4, replication=1
        )
        assert (await _wait(job, _ended))["state"] == "completed"
        hidden = (await asyncio.to_thread(job.result))["last_hidden_state"]
    finally:
        worker.stop()
        await running
        client.close()
    mask = arrays["attention_mask"][:, :, None].astype(np.float32)
    pooled = (hidden * mask).sum(axis=1) / mask.sum(axis=1)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    assert float(row_cosines(pooled.astype(np.float32), embed_reference(texts)).min()) > 1 - 1e-6
