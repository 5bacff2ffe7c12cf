"""The `idlegrid` command line: run a coordinator or a worker, submit and follow jobs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import click

from idlegrid import __version__
from idlegrid.cli_researcher import COMMANDS


def _setup_logging(level: str) -> None:
    """Rich lines on a terminal, plain timestamped ones in a log file; Alembic's INFO
    chatter (one line per migration step) only with --log-level debug."""
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
    if level.lower() != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)


class _Cli(click.Group):
    """The `idlegrid` group: an expected failure ends in one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        from idlegrid.errors import explain

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            message = explain(exc, server=_server_of(ctx))
            if message is None or ctx.params.get("debug"):
                raise
            raise click.ClickException(message) from None


def _server_of(ctx: click.Context) -> str:
    return str(ctx.meta.get("idlegrid.server", ""))


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="idlegrid")
@click.option(
    "--debug",
    is_flag=True,
    envvar="IDLEGRID_DEBUG",
    help="Show the full traceback of a failure (env IDLEGRID_DEBUG=1).",
)
def main(debug: bool) -> None:
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
    """Run the coordinator: the REST API and the node WebSocket.

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
    envvar=["IDLEGRID_SERVERS", "IDLEGRID_SERVER"],
    default=["http://127.0.0.1:8000"],
    show_default=True,
    help="Coordinator URL; repeat for fail-over (env IDLEGRID_SERVERS, a comma list, or "
    "IDLEGRID_SERVER).",
)
@click.option(
    "--token",
    "-t",
    envvar="IDLEGRID_NODE_TOKEN",
    default="",
    help="Node token (env IDLEGRID_NODE_TOKEN; better than the flag, which `ps` shows).",
)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="IDLEGRID_NODE_TOKEN_FILE",
    default=None,
    help="File holding the node token, readable by its owner only (chmod 600).",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Node identity, blob cache, benchmark (default ~/.idlegrid/worker).",
)
@click.option("--name", default="", help="The node's name in `GET /v1/nodes` (default: host).")
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
    token_file: Path | None,
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
    backoff when it goes away, and only runs built-in task kinds. Ctrl-C once: finish
    the running tasks, then stop; twice: give them back to the coordinator and stop.
    """
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker.daemon import Worker

    _setup_logging(log_level)
    expanded = tuple(part for s in servers for part in s.split(",") if part)
    settings = WorkerSettings.from_env(
        servers=expanded,
        token=_node_token(token, token_file),
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
    from idlegrid.worker.daemon import NodeRefused

    try:
        node = Worker(settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        asyncio.run(_run_worker(node))
    except NodeRefused as exc:
        raise click.ClickException(f"{exc} (make one: idlegrid token create --node)") from None


def _node_token(token: str, token_file: Path | None) -> str:
    """The node token from the environment (or flag), else from a 0600 file."""
    if not token and token_file is not None:
        token = _read_secret(token_file)
    if not token:
        hint = ""
        if os.environ.get("IDLEGRID_TOKEN"):
            hint = " (IDLEGRID_TOKEN is a researcher's token; a worker reads IDLEGRID_NODE_TOKEN)"
        raise click.UsageError(
            "a node token is needed: set IDLEGRID_NODE_TOKEN or pass --token-file FILE"
            f"{hint}; an admin makes one with: idlegrid token create --node --account NAME"
        )
    if token.startswith("igr_"):
        raise click.UsageError(
            "that is a researcher token (igr_...): a worker needs a node token (ign_...), "
            "made with: idlegrid token create --node --account NAME"
        )
    return token


def _read_secret(path: Path) -> str:
    """A token file's content; refused when others may read it, as ssh does for keys."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise click.UsageError(
            f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 {path}"
        )
    secret = path.read_text().strip()
    if not secret:
        raise click.UsageError(f"{path} is empty: it should hold a node token (ign_...)")
    return secret


async def _run_worker(node: Any) -> None:
    """Run until stopped: the first SIGINT/SIGTERM finishes, the second gives back."""
    loop = asyncio.get_running_loop()
    owned: set[asyncio.Task[None]] = set()
    asked = 0

    def on_signal() -> None:
        nonlocal asked
        asked += 1
        if asked == 1:
            click.echo(
                "finishing the running tasks, then stopping (Ctrl-C again: give them back "
                "and stop now)",
                err=True,
            )
            step = node.finish()
        else:
            click.echo("giving the running tasks back to the coordinator and stopping", err=True)
            step = node.give_back_and_stop()
        task = loop.create_task(step)
        owned.add(task)
        task.add_done_callback(owned.discard)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await node.run()
    finally:
        await asyncio.gather(*owned, return_exceptions=True)


# -- researcher and admin commands (cli_researcher.py) --------------------------------------

for _command in COMMANDS:
    main.add_command(_command)


@main.command()
@click.option("--texts", default=2000, show_default=True, help="Texts to embed.")
@click.option(
    "--workers", default=0, help="Local worker processes (default: as many as replication)."
)
@click.option(
    "--replication", default=3, show_default=True, help="Replicas per shard, verified by quorum."
)
@click.option("--shard-size", default=128, show_default=True)
def demo(texts: int, workers: int, replication: int, shard_size: int) -> None:
    """Run the whole grid on this machine: a coordinator, workers, an embedding job.

    Each worker is a volunteer with its own account; every shard runs on `replication`
    of them and a quorum decides its result. Embeds paragraphs of the standard library's
    docstrings, checks every vector against a local reference (cosine >= 0.999), prints
    the throughput and the credit each node earned, and stops everything it started.
    """
    from idlegrid.demo import run_demo

    sys.exit(run_demo(texts=texts, workers=workers, replication=replication, shard_size=shard_size))


if __name__ == "__main__":
    main()
