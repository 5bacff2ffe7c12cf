"""`idlegrid demo`: a coordinator, local workers and a real embedding job, checked."""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from idlegrid.devtools.localgrid import LocalGrid

COSINE_FLOOR = 0.999


def run_demo(
    *,
    texts: int,
    workers: int,
    replication: int,
    shard_size: int,
    keep: bool = False,
    port: int = 0,
) -> int:
    """Run the demo; return the process exit code (0 when every row checked out).

    `keep`: leave the coordinator and workers running after the job, print the
    dashboard's URL and a demo sign-in, and stop everything on Ctrl-C. `port`: the
    coordinator's (0: any free one).
    """
    console = Console()
    from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

    if not port_is_free(port, console):
        return 2

    workers = _enough_workers(console, workers, replication)
    corpus = stdlib_paragraphs(texts)
    console.print(f"corpus: {len(corpus)} paragraphs of standard-library docstrings")
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-demo-") as tmp,
        LocalGrid(Path(tmp), replication=replication, port=port) as grid,
    ):
        console.print(f"coordinator: {grid.url} (SQLite in {grid.data_dir})")
        threads = 1 if workers > 1 else 0
        _start_workers(console, grid, workers, kinds="embed-text", threads=threads)
        vectors = _embed_on_grid(
            console, grid, corpus, shard_size=shard_size, replication=replication, workers=workers
        )
        code = _check(console, corpus, vectors)
        if keep:
            _keep_running(console, grid)
    console.print("all processes stopped")
    return code


def _enough_workers(console: Console, workers: int, replication: int) -> int:
    """The workers to start: as many as asked, at least one per replica (said if raised)."""
    if workers < replication:
        if workers:
            console.print(
                f"replication {replication} needs {replication} workers: starting that many"
            )
        workers = replication
    return workers


def _start_workers(
    console: Console, grid: LocalGrid, workers: int, *, kinds: str, threads: int
) -> None:
    """Start `workers` local workers of `kinds` and wait until each has connected."""
    for i in range(workers):
        grid.start_worker(f"worker-{i + 1}", kinds=kinds, threads=threads)
    with console.status(f"waiting for {workers} workers to benchmark and connect"):
        grid.wait_for_nodes(workers)


def _embed_on_grid(
    console: Console,
    grid: LocalGrid,
    corpus: list[str],
    *,
    shard_size: int,
    replication: int,
    workers: int,
) -> np.ndarray:
    """Embed `corpus` on the grid, printing the nodes, the quorum's work and the throughput."""
    with grid.client() as client:
        for node in client.nodes():
            rate = node["benchmark"].get("kind_rates", {}).get("embed-text", 0)
            console.print(
                f"  node {node['id']} {node['name']}: "
                f"{node['benchmark']['matmul_gflops']:.1f} GFLOPS, "
                f"{rate:.0f} texts/s"
            )
        started = time.perf_counter()
        job = client.submit_embeddings(corpus, shard_size=shard_size)
        job.wait(progress=True)
        vectors = job.result()
        elapsed = time.perf_counter() - started
        status = job.info()
        console.print(
            f"verified: {status['shards_total']} shards, each run by up to {replication} "
            "volunteers on distinct accounts and decided by a credibility-weighted quorum "
            f"({status['tasks_completed']} tasks, effective replication "
            f"{status['effective_replication']})"
        )
        for node in client.nodes():
            console.print(
                f"  node {node['id']} {node['name']}: credit {node['credit_total']:.4f} "
                "(validated work only)"
            )
    console.print(
        f"grid: {len(corpus)} texts in {elapsed:.1f} s = "
        f"[bold]{len(corpus) / elapsed:.0f} texts/s[/] with {workers} workers"
    )
    return vectors


# The coordinator makes this admin account on its first start; LocalGrid's client
# submits with its token.
DEMO_LOGIN = "admin"


def _keep_running(console: Console, grid: LocalGrid) -> None:
    """Give the account that submitted the demo's job (the coordinator's admin) a
    password, print where the dashboard is, and wait for Ctrl-C: signed in, the job's
    page, the admin pages and the workers' nodes are all there to see."""
    password = secrets.token_urlsafe(12)
    subprocess.run(
        [sys.executable, "-m", "idlegrid", "web-account", DEMO_LOGIN, "--role", "admin"]
        + ["--password-file", "-", "--data-dir", str(grid.data_dir)],
        input=password + "\n",
        text=True,
        check=True,
        env=grid.env,
        capture_output=True,
    )
    console.print(
        f"dashboard: [bold]{grid.url}/[/]  sign in as [bold]{DEMO_LOGIN}[/] / [bold]{password}[/]"
    )
    console.print("the coordinator and workers keep running; press Ctrl-C to stop them")
    try:
        while True:
            time.sleep(1.0)
            grid._check_alive()
    except KeyboardInterrupt:
        # A second Ctrl-C must not cut the orderly stop short (it escalates by itself).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        console.print("stopping")


def _check(console: Console, corpus: list[str], vectors: np.ndarray) -> int:
    from idlegrid.kinds.embed_text.kind import embed_reference

    with console.status("computing the reference embedding in this process"):
        reference = embed_reference(corpus)
    if vectors.shape != reference.shape:
        console.print(f"[red]shape {vectors.shape} != reference {reference.shape}")
        return 1
    cosine = np.sum(vectors * reference, axis=1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    )
    worst = float(cosine.min())
    ok = bool(np.all(cosine >= COSINE_FLOOR))
    verdict = "[green]OK" if ok else "[red]FAILED"
    console.print(
        f"check: {vectors.shape[0]} rows, min cosine vs reference {worst:.6f} "
        f"(floor {COSINE_FLOOR}) {verdict}"
    )
    return 0 if ok else 1


def run_onnx_demo(
    *,
    images: int,
    workers: int,
    replication: int,
    shard_size: int,
    keep: bool = False,
    port: int = 0,
) -> int:
    """The image flow end to end: a small convolutional network built here, drawn images
    as files, workers that decode them with Pillow and run ONNX Runtime; every row is
    checked against ONNX Runtime in this process. Returns the exit code.

    `keep`: as for `run_demo`, the grid stays up for the dashboard until Ctrl-C."""
    from idlegrid.kinds.onnx import examples as onnx_examples

    console = Console()
    if not port_is_free(port, console):
        return 2
    workers = max(workers, replication)
    model = onnx_examples.conv_net()
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-demo-") as tmp,
        LocalGrid(Path(tmp), replication=replication, port=port) as grid,
    ):
        paths = _draw_images(Path(tmp) / "images", images)
        console.print(f"{len(paths)} images drawn in {paths[0].parent}; model: conv_net (ONNX)")
        console.print(f"coordinator: {grid.url} (SQLite in {grid.data_dir})")
        _start_workers(console, grid, workers, kinds="onnx-infer", threads=1)
        result = _infer_on_grid(console, grid, model, paths, shard_size=shard_size, workers=workers)
        code = _check_onnx(console, model, paths, result)
        if keep:
            _keep_running(console, grid)
    console.print("all processes stopped")
    return code


def _infer_on_grid(
    console: Console,
    grid: LocalGrid,
    model: bytes,
    paths: list[Path],
    *,
    shard_size: int,
    workers: int,
) -> dict[str, np.ndarray]:
    """Run the images through `model` on the grid, printing the nodes and the job's figures."""
    from idlegrid.kinds.onnx import examples as onnx_examples

    with grid.client() as client:
        for node in client.nodes():
            providers = node["hardware"].get("onnx_providers", [])
            console.print(f"  node {node['id']} {node['name']}: providers {providers}")
        started = time.perf_counter()
        job = client.submit_images(
            model, paths, preprocess=onnx_examples.IMAGENET_PREPROCESS, shard_size=shard_size
        )
        job.wait(progress=True)
        result = job.result()
        elapsed = time.perf_counter() - started
        status = job.info()
    console.print(
        f"grid: {len(paths)} images in {elapsed:.1f} s with {workers} workers, "
        f"{status['shards_total']} shards, {status['tasks_completed']} tasks "
        f"(effective replication {status['effective_replication']})"
    )
    return result


def _draw_images(folder: Path, count: int) -> list[Path]:
    from idlegrid.kinds.onnx.examples import images

    folder.mkdir(parents=True)
    paths = []
    for index, blob in enumerate(images(count, seed=11)):
        kind = "jpg" if index % 3 == 0 else "png"
        path = folder / f"picture-{index:05d}.{kind}"
        if kind == "jpg":  # some JPEGs too: both decoders run on the workers
            from io import BytesIO

            from PIL import Image

            buffer = BytesIO()
            Image.open(BytesIO(blob)).convert("RGB").save(buffer, format="JPEG", quality=90)
            blob = buffer.getvalue()
        path.write_bytes(blob)
        paths.append(path)
    return paths


def _check_onnx(
    console: Console, model: bytes, paths: list[Path], result: dict[str, np.ndarray]
) -> int:
    import onnxruntime as ort

    from idlegrid.kinds.onnx import data as onnx_data
    from idlegrid.kinds.onnx.compare import Tolerance, arrays_agree, distances
    from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS

    spec = onnx_data.Preprocess.model_validate(IMAGENET_PREPROCESS)
    batch = onnx_data.decode_batch(
        onnx_data.load_images(onnx_data.zip_files(paths)), spec, "float32"
    )
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    reference = dict(zip(names, session.run(names, {"image": batch}), strict=True))
    ok = True
    for name in names:
        agree = arrays_agree(result[name], reference[name], Tolerance())
        relative, cosine_gap = distances(result[name], reference[name])
        console.print(
            f"check {name}: {result[name].shape[0]} rows vs local ONNX Runtime, "
            f"max row-relative diff {relative:.1e}, max 1-cos {cosine_gap:.1e} "
            + ("[green]OK" if agree else "[red]FAILED")
        )
        ok = ok and agree
    return 0 if ok else 1


def port_is_free(port: int, console: Console) -> bool:
    """Whether the coordinator can listen on 127.0.0.1:`port` (0: any port is); if not,
    says so, with the option that picks another."""
    if port == 0:
        return True
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            console.print(
                f"[red]port {port} on 127.0.0.1 is taken ({exc.strerror}): give another "
                "with --port, or --port 0 for any free one"
            )
            return False
    return True
