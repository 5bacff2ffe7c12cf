"""`idlegrid demo`: a coordinator, local workers and a real embedding job, checked."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from idlegrid.localgrid import LocalGrid

COSINE_FLOOR = 0.999


def run_demo(
    *, texts: int, workers: int, replication: int, shard_size: int, keep: bool = False
) -> int:
    """Run the demo; return the process exit code (0 when every row checked out).

    `keep`: leave the coordinator and workers running after the job, print the
    dashboard's URL and a demo sign-in, and stop everything on Ctrl-C.
    """
    console = Console()
    from idlegrid.corpus import stdlib_paragraphs

    if workers < replication:
        if workers:
            console.print(
                f"replication {replication} needs {replication} workers: starting that many"
            )
        workers = replication
    corpus = stdlib_paragraphs(texts)
    console.print(f"corpus: {len(corpus)} paragraphs of standard-library docstrings")
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-demo-") as tmp,
        LocalGrid(Path(tmp), replication=replication) as grid,
    ):
        console.print(f"coordinator: {grid.url} (SQLite in {grid.data_dir})")
        threads = 1 if workers > 1 else 0
        for i in range(workers):
            grid.start_worker(f"worker-{i + 1}", kinds="embed-text", threads=threads)
        with console.status(f"waiting for {workers} workers to benchmark and connect"):
            grid.wait_for_nodes(workers)
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
        code = _check(console, corpus, vectors)
        if keep:
            _keep_running(console, grid)
    console.print("all processes stopped")
    return code


def _keep_running(console: Console, grid: LocalGrid) -> None:
    """Make a demo sign-in, print where the dashboard is, and wait for Ctrl-C."""
    password = secrets.token_urlsafe(12)
    subprocess.run(
        [sys.executable, "-m", "idlegrid", "web-account", "demo", "--role", "admin"]
        + ["--password-file", "-", "--data-dir", str(grid.data_dir)],
        input=password + "\n",
        text=True,
        check=True,
        env=grid.env,
        capture_output=True,
    )
    console.print(
        f"dashboard: [bold]{grid.url}/[/]  sign in as [bold]demo[/] / [bold]{password}[/]"
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
    from idlegrid.kinds.embed_text import embed_reference

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
