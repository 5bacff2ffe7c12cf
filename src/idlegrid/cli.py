"""The `idlegrid` command line: run a coordinator or a worker, submit and follow jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import click

from idlegrid import __version__

server_option = click.option(
    "--server",
    "-s",
    envvar="IDLEGRID_SERVER",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Coordinator URL (env IDLEGRID_SERVER).",
)
token_option = click.option(
    "--token",
    "-t",
    envvar="IDLEGRID_TOKEN",
    required=True,
    help="Researcher API token (env IDLEGRID_TOKEN).",
)


def _setup_logging(level: str) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:  # log files: one plain line per record
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="idlegrid")
def main() -> None:
    """idlegrid: turn idle machines into one pool for machine-learning work.

    Run a coordinator (`serve`), connect workers to it (`worker`), then submit jobs
    (`submit`) and follow them (`jobs`, `job`, `results`). `demo` does all of it on this
    machine in one command.
    """


# -- serve ----------------------------------------------------------------------------------


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    envvar="IDLEGRID_DATA_DIR",
    default=Path("./idlegrid-data"),
    show_default=True,
    help="Where the SQLite database, blobs and admin token live.",
)
@click.option(
    "--database",
    envvar="IDLEGRID_DATABASE_URL",
    default="",
    help="Database URL (postgresql://user@host/db); default: SQLite in the data dir.",
)
@click.option(
    "--database-schema",
    default=None,
    help="PostgreSQL schema of the tables, made if missing (env IDLEGRID_DATABASE_SCHEMA).",
)
@click.option(
    "--redis",
    "redis_url",
    envvar="IDLEGRID_REDIS_URL",
    default="",
    help="Redis URL (redis://host:6379/0) for several coordinators; default: in-process.",
)
@click.option(
    "--redis-prefix",
    default=None,
    help="Prefix of every Redis key (env IDLEGRID_REDIS_PREFIX; default idlegrid:).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=int,
    help="Port to listen on; 0 picks a free one (printed).",
)
@click.option(
    "--heartbeat-interval",
    type=float,
    default=None,
    help="Seconds between node heartbeats (default 15).",
)
@click.option(
    "--node-timeout",
    type=float,
    default=None,
    help="Seconds of silence before a node is offline and its tasks requeued.",
)
@click.option("--min-lease", type=float, default=None, help="Shortest task lease, seconds.")
@click.option("--max-blob-mb", type=float, default=None, help="Largest upload, MiB.")
@click.option("--log-level", default="info", show_default=True)
def serve(
    data_dir: Path,
    database: str,
    database_schema: str | None,
    redis_url: str,
    redis_prefix: str | None,
    host: str,
    port: int,
    heartbeat_interval: float | None,
    node_timeout: float | None,
    min_lease: float | None,
    max_blob_mb: float | None,
    log_level: str,
) -> None:
    """Run the coordinator: REST API, node WebSocket and dashboard API.

    On first start it creates an admin account and writes its API token to
    DATA_DIR/admin-token. Open /docs for the API reference.
    """
    import uvicorn

    from idlegrid.coordinator.app import create_app
    from idlegrid.settings import CoordinatorSettings

    _setup_logging(log_level)
    settings = CoordinatorSettings.from_env(
        data_dir=data_dir,
        database_url=database or None,
        database_schema=database_schema,
        redis_url=redis_url or None,
        redis_prefix=redis_prefix,
        host=host,
        port=port,
        heartbeat_interval_s=heartbeat_interval,
        node_timeout_s=node_timeout,
        min_lease_s=min_lease,
        max_blob_bytes=int(max_blob_mb * 1024 * 1024) if max_blob_mb else None,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings, owns_process=True),
        log_level=log_level,
        lifespan="on",
        access_log=log_level == "debug",
        ws_max_size=16 * 1024 * 1024,
        # Node messages are small JSON: deflate would cost CPU and a zlib context per node.
        ws_per_message_deflate=False,
        # Nodes send heartbeats (acknowledged) and silent ones are closed after the node
        # timeout: WebSocket pings from this side would double the frames of an idle fleet.
        ws_ping_interval=None,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    click.echo(f"idlegrid coordinator listening on http://{host}:{bound}", err=False)
    click.echo(
        f"admin token: {settings.admin_token_file} (read it with: cat {settings.admin_token_file})"
    )
    sys.stdout.flush()
    _run_profiled(lambda: server.run(sockets=[sock]), os.environ.get("IDLEGRID_PROFILE", ""))


def _run_profiled(run: Any, path: str) -> None:
    """Run; with IDLEGRID_PROFILE=FILE, under cProfile, its stats written to FILE at exit."""
    if not path:
        run()
        return
    import cProfile

    # uvicorn re-raises SIGTERM once shut down: exit through `finally` instead of dying.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import time

    # CPU time of the event loop's thread: on a busy machine, wall time would charge other
    # processes' turns to whatever function was running.
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
        profiler.dump_stats(path)


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    envvar="IDLEGRID_DATA_DIR",
    default=Path("./idlegrid-data"),
    show_default=True,
    help="Where the SQLite database lives (when no --database is given).",
)
@click.option("--database", envvar="IDLEGRID_DATABASE_URL", default="", help="Database URL.")
@click.option(
    "--database-schema", default=None, help="PostgreSQL schema (env IDLEGRID_DATABASE_SCHEMA)."
)
def migrate(data_dir: Path, database: str, database_schema: str | None) -> None:
    """Bring the database to this version's schema, then exit.

    `serve` does the same on start (one process at a time); run this first to upgrade a
    production database before restarting the coordinators.
    """
    from idlegrid.settings import CoordinatorSettings
    from idlegrid.store import open_store

    settings = CoordinatorSettings.from_env(
        data_dir=data_dir, database_url=database or None, database_schema=database_schema
    )
    if not settings.database_url:
        data_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> None:
        store = open_store(settings.database, schema=settings.database_schema)
        try:
            await store.open()
        finally:
            await store.close()

    asyncio.run(run())
    click.echo("the database is at the newest migration")


# -- worker ---------------------------------------------------------------------------------


@main.command()
@click.option(
    "--server",
    "-s",
    "servers",
    multiple=True,
    envvar="IDLEGRID_SERVERS",
    default=["http://127.0.0.1:8000"],
    show_default=True,
    help="Coordinator URL; repeat for fail-over (env IDLEGRID_SERVERS, comma list).",
)
@click.option(
    "--token",
    "-t",
    envvar="IDLEGRID_NODE_TOKEN",
    required=True,
    help="Node token (env IDLEGRID_NODE_TOKEN).",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Node identity, blob cache, benchmark (default ~/.idlegrid/worker).",
)
@click.option("--name", default="", help="A name shown on the dashboard.")
@click.option("--slots", default=1, show_default=True, help="Tasks to run at once.")
@click.option(
    "--prefetch",
    default=0,
    show_default=True,
    help="Tasks to hold beyond the slots, started when one frees (for short tasks).",
)
@click.option("--kinds", default="", help="Comma list of kinds to offer (default: all usable).")
@click.option("--device", default="", help="Torch device (default: best of cuda/mps/cpu).")
@click.option("--threads", default=0, help="Torch threads (default: cores / slots).")
@click.option(
    "--benchmark/--no-benchmark",
    default=True,
    show_default=True,
    help="Benchmark at registration (cached per hardware).",
)
@click.option("--rebenchmark", is_flag=True, help="Run the benchmark again.")
@click.option("--log-level", default="info", show_default=True)
def worker(
    servers: tuple[str, ...],
    token: str,
    state_dir: Path | None,
    name: str,
    slots: int,
    prefetch: int,
    kinds: str,
    device: str,
    threads: int,
    benchmark: bool,
    rebenchmark: bool,
    log_level: str,
) -> None:
    """Run a worker node: probe and benchmark this machine, then take tasks.

    The worker connects out to the coordinator (works behind NAT), reconnects with
    backoff when it goes away, and only runs built-in task kinds.
    """
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker.daemon import Worker

    _setup_logging(log_level)
    expanded = tuple(part for s in servers for part in s.split(",") if part)
    settings = WorkerSettings.from_env(
        servers=expanded,
        token=token,
        state_dir=state_dir,
        name=name or socket.gethostname(),
        slots=slots,
        prefetch=prefetch,
        kinds=tuple(k for k in kinds.split(",") if k) or None,
        device=device or None,
        threads=threads or None,
        benchmark=benchmark,
        rebenchmark=rebenchmark,
    )
    try:
        node = Worker(settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(_run_worker(node))


async def _run_worker(node: Any) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.stop)
    await node.run()


# -- researcher commands --------------------------------------------------------------------


def _client(server: str, token: str) -> Any:
    from idlegrid.client import Client

    return Client(server, token)


def _fail(exc: Exception) -> None:
    raise click.ClickException(str(exc))


@main.command()
@click.argument("kind")
@click.argument("inputs", nargs=-1)
@click.option(
    "--param",
    "-p",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help="A setting of the kind, e.g. -p shard_size=128 (value parsed as JSON).",
)
@click.option("--replication", type=int, default=None, help="Replicas per shard.")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--wait/--no-wait", default=False, help="Wait with a progress bar.")
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="With --wait: save the result here.",
)
@server_option
@token_option
def submit(
    kind: str,
    inputs: tuple[str, ...],
    params: tuple[str, ...],
    replication: int | None,
    priority: int,
    wait: bool,
    output: Path | None,
    server: str,
    token: str,
) -> None:
    """Submit a job: KIND and its inputs as NAME=PATH, or PATHs in the kind's input order.

    \b
    idlegrid submit embed-text texts.jsonl --wait -o vectors.npy
    idlegrid submit sleep -p tasks=20 -p seconds=0.5
    idlegrid submit onnx-infer model.onnx data.safetensors --wait -o out.safetensors
    idlegrid submit onnx-infer model.onnx photos/ --wait -o out.safetensors \\
        -p 'preprocess={"crop": [224, 224], "resize": 256, "mean": [0.485, 0.456, 0.406],
                        "std": [0.229, 0.224, 0.225]}'

    A folder as onnx-infer's data is its .jpg/.jpeg/.png files, in name order.
    """
    from idlegrid.client import IdlegridError
    from idlegrid.kinds import UnknownKind, get_kind

    try:
        names = get_kind(kind).input_names
    except UnknownKind as exc:
        raise click.BadParameter(str(exc), param_hint="KIND") from None
    files = _input_files(inputs, names)
    settings = {}
    for item in params:
        key, _, raw = item.partition("=")
        try:
            settings[key] = json.loads(raw)
        except ValueError:
            settings[key] = raw
    try:
        client = _client(server, token)
        job = client.submit(
            kind,
            inputs={n: _input_bytes(p) for n, p in files.items()},
            params=settings,
            replication=replication,
            priority=priority,
        )
        click.echo(f"job {job.id} submitted")
        if wait:
            job.wait(progress=True)
            if output:
                output.write_bytes(job.result_bytes())
                click.echo(f"result saved to {output}")
    except (IdlegridError, OSError) as exc:
        _fail(exc)


def _input_files(inputs: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Path]:
    files: dict[str, Path] = {}
    positional = [item for item in inputs if "=" not in item]
    if (positional and len(positional) != len(inputs)) or len(positional) > len(names):
        raise click.BadParameter(
            f"this kind takes inputs {list(names)}: give them in that order, or as NAME=PATH"
        )
    if positional:
        return {name: Path(item) for name, item in zip(names, positional, strict=False)}
    for item in inputs:
        name, _, path = item.partition("=")
        files[name] = Path(path)
    return files


def _input_bytes(path: Path) -> bytes:
    """A file's bytes; a folder is its images, zipped in name order (with a progress bar)."""
    if not path.is_dir():
        return path.read_bytes()
    from rich.progress import Progress

    from idlegrid.kinds.onnx_data import IMAGE_SUFFIXES, zip_files

    found = sorted(p for p in path.iterdir() if p.name.lower().endswith(IMAGE_SUFFIXES))
    if not found:
        raise click.BadParameter(f"{path} holds no .jpg, .jpeg or .png file")
    with Progress() as progress:
        bar = progress.add_task(f"reading {len(found)} images", total=len(found))
        return zip_files(found, on_file=lambda: progress.advance(bar))


@main.command()
@click.option("--limit", default=20, show_default=True)
@server_option
@token_option
def jobs(limit: int, server: str, token: str) -> None:
    """List your jobs, newest first."""
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "kind", "state", "shards", "items", "error")
    try:
        for job in _client(server, token).jobs(limit=limit):
            table.add_row(
                str(job["id"]),
                job["kind"],
                job["state"],
                f"{job['shards_done']}/{job['shards_total']}",
                str(job["items_total"]),
                (job["error"] or "")[:60],
            )
    except Exception as exc:
        _fail(exc)
    Console().print(table)


@main.command()
@click.argument("job_id", type=int)
@click.option("--watch", is_flag=True, help="Follow progress until the job ends.")
@click.option("--cancel", is_flag=True, help="Cancel the job.")
@server_option
@token_option
def job(job_id: int, watch: bool, cancel: bool, server: str, token: str) -> None:
    """Show one job with its shards; --watch follows it, --cancel stops it."""
    from idlegrid.client import IdlegridError

    try:
        handle = _client(server, token).job(job_id)
        if cancel:
            handle.cancel()
        if watch:
            handle.wait(progress=True)
        info = handle.info(shards=True)
    except IdlegridError as exc:
        _fail(exc)
    shards = info.pop("shards") or []
    click.echo(json.dumps(info, indent=2))
    for reason in info.get("waiting_for") or []:
        click.echo(f"waiting for: {reason}")
    click.echo(f"shards: {info['shard_counts']}")
    for shard in shards[:50]:
        click.echo(
            f"  #{shard['index']:<5} {shard['state']:<9} items={shard['items']:<5} "
            f"attempts={shard['attempts']} running={shard['live_tasks']} "
            f"progress={shard['progress']:.0%}"
        )
    if len(shards) > 50:
        click.echo(f"  ... {len(shards) - 50} more")


@main.command()
@click.argument("job_id", type=int)
@click.option("--watch", is_flag=True, help="Follow training with progress bars until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@server_option
@token_option
def metrics(job_id: int, watch: bool, as_json: bool, server: str, token: str) -> None:
    """Per-round metrics of a training job (losses, bytes up and down, time, nodes)."""
    from rich.console import Console
    from rich.table import Table

    from idlegrid.client import IdlegridError

    try:
        with _client(server, token) as client:
            handle = client.job(job_id)
            if watch:
                with contextlib.suppress(IdlegridError):  # a failed job still has its metrics
                    handle.wait(progress=True)
            found = handle.metrics()
    except IdlegridError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    table = Table("round", "state", "train loss", "eval loss", "updates", "nodes",
                  "bytes up", "bytes down", "seconds", "closed by")  # fmt: skip
    for row in found["rounds"]:
        table.add_row(
            str(row["round"]) + (" (final)" if row["final"] else ""),
            row["state"],
            _number(row["train_loss"]),
            _number(row["eval_loss"]),
            "" if row["updates"] is None else str(row["updates"]),
            str(row["nodes"]),
            _number(row["bytes_up"], "{:,}"),
            _number(row["bytes_down"], "{:,}"),
            _number(row["round_time_s"], "{:.1f}"),
            row["closed_by"] or "",
        )
    Console().print(table)
    click.echo(f"job {job_id} {found['state']}: {found['rounds_done']}/{found['rounds_total']} "
               f"rounds, {found['bytes_up']:,} B up, {found['bytes_down']:,} B down")  # fmt: skip


def _number(value: float | None, form: str = "{:.4f}") -> str:
    return "" if value is None else form.format(value)


@main.command()
@click.argument("job_id", type=int)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    required=True,
    help="File to write (embed-text: a .npy float32 array).",
)
@server_option
@token_option
def results(job_id: int, output: Path, server: str, token: str) -> None:
    """Download a completed job's result."""
    from idlegrid.client import IdlegridError

    try:
        data = _client(server, token).job(job_id).result_bytes()
    except IdlegridError as exc:
        _fail(exc)
    output.write_bytes(data)
    click.echo(f"{len(data)} bytes written to {output}")


@main.group()
def token() -> None:
    """Manage API and node tokens."""


@token.command("create")
@click.option("--node", "is_node", is_flag=True, help="A node token (for `idlegrid worker`).")
@click.option("--account", default=None, help="Admin only: for this account (made if new).")
@click.option("--label", default="", help="A note to remember the token by.")
@server_option
@token_option
def token_create(is_node: bool, account: str | None, label: str, server: str, token: str) -> None:
    """Create a token; it is shown once and stored only as a hash."""
    from idlegrid.client import IdlegridError

    try:
        made = _client(server, token).create_token(
            kind="node" if is_node else "api", label=label, account=account
        )
    except IdlegridError as exc:
        _fail(exc)
    click.echo(made["token"])
    click.echo(f"({made['kind']} token for account {made['account']})", err=True)


@main.command()
@click.option(
    "--kind",
    type=click.Choice(["embed-text", "onnx-infer"]),
    default="embed-text",
    show_default=True,
    help="embed-text: paragraphs through all-MiniLM-L6-v2; onnx-infer: images through a "
    "small convolutional network on ONNX Runtime.",
)
@click.option("--texts", default=2000, show_default=True, help="Texts to embed.")
@click.option("--images", default=500, show_default=True, help="Images (onnx-infer).")
@click.option(
    "--workers", default=0, help="Local worker processes (default: as many as replication)."
)
@click.option(
    "--replication", default=3, show_default=True, help="Replicas per shard, verified by quorum."
)
@click.option("--shard-size", default=128, show_default=True)
def demo(
    kind: str, texts: int, images: int, workers: int, replication: int, shard_size: int
) -> None:
    """Run the whole grid on this machine: a coordinator, workers, a real job.

    Each worker is a volunteer with its own account; every shard runs on `replication`
    of them and a quorum decides its result. embed-text embeds paragraphs of the standard
    library's docstrings and checks every vector against a local reference (cosine >=
    0.999); onnx-infer runs drawn images (PNG and JPEG files) through a convolutional
    network and checks every row against ONNX Runtime run here. Both print the
    throughput and stop everything they started.
    """
    from idlegrid.demo import run_demo, run_onnx_demo

    if kind == "onnx-infer":
        sys.exit(
            run_onnx_demo(
                images=images, workers=workers, replication=replication, shard_size=shard_size
            )
        )
    sys.exit(run_demo(texts=texts, workers=workers, replication=replication, shard_size=shard_size))


if __name__ == "__main__":
    main()
