"""The `idlegrid` command line: run a coordinator or a worker, submit and follow jobs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import click

from idlegrid import __version__
from idlegrid.cli.researcher import COMMANDS
from idlegrid.logs import setup_logging as _setup_logging


class _Cli(click.Group):
    """The `idlegrid` group: an expected failure ends in one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        from idlegrid.cli.errors import explain

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
@click.option(
    "--max-blob-mb",
    type=float,
    default=None,
    help="Largest blob sent in one request, MiB [default: 256] (env IDLEGRID_MAX_BLOB_BYTES, "
    "in bytes). Larger ones (a model's weights) go in chunks, as the SDK and CLI send "
    "them, up to the account's quota_blob_bytes (10 GiB).",
)
@click.option(
    "--replica-networks",
    type=click.Choice(["distinct", "address", "shared"]),
    envvar="IDLEGRID_REPLICA_NETWORKS",
    default=None,
    help="How strictly a shard's replicas must come from different networks: distinct "
    "(default; IPv4 /24, IPv6 /48), address (each address its own: a lab), shared (no "
    "rule: one machine or one NAT). docs/operations.md, 'Replicas and networks'.",
)
@click.option(
    "--p2p",
    type=click.Choice(["auto", "on", "off"]),
    default=None,
    help="Bootstrap DHT peer for peer-to-peer training (the p2p extra); default auto, "
    "or IDLEGRID_P2P.",
)
@click.option(
    "--p2p-host",
    default=None,
    help="Address the bootstrap DHT peer listens on (env IDLEGRID_P2P_HOST); default: "
    "--host's, so a coordinator on 127.0.0.1 opens no port on other interfaces.",
)
@click.option(
    "--p2p-port",
    type=int,
    default=None,
    help="Port of the bootstrap DHT peer (env IDLEGRID_P2P_PORT); default: any free one.",
)
@click.option(
    "--build-downloads/--no-build-downloads",
    default=None,
    help="Build the worker wheel /download serves at start when DATA_DIR/downloads lacks "
    "this version's, from this install (a source checkout, or the wheel it came from; "
    "seconds); default on (env IDLEGRID_BUILD_DOWNLOADS). The one-file worker: "
    "scripts/build-downloads.sh.",
)
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
    replica_networks: str | None,
    p2p: str | None,
    p2p_host: str | None,
    p2p_port: int | None,
    build_downloads: bool | None,
    log_level: str,
) -> None:
    """Run the coordinator: the REST API and the node WebSocket.

    It listens on --host and --port (default 127.0.0.1:8000: this machine only; 0.0.0.0
    for every interface) and, when the p2p extra is installed, runs a bootstrap DHT peer
    for peer-to-peer training on the same host at any free port (--p2p-host, --p2p-port;
    --p2p off: none). It prints every address it listens on.

    On first start it creates an admin account and writes its API token to
    DATA_DIR/admin-token. Open /docs for the API reference.
    """
    import uvicorn

    from idlegrid.app import create_app
    from idlegrid.coordinator.serving import uvicorn_config
    from idlegrid.settings import REPLICA_NETWORKS, CoordinatorSettings

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
        **(REPLICA_NETWORKS[replica_networks] if replica_networks else {}),
        p2p=p2p or os.environ.get("IDLEGRID_P2P") or "auto",
        p2p_host=p2p_host,
        p2p_port=p2p_port,
        build_downloads=_flag("IDLEGRID_BUILD_DOWNLOADS", build_downloads, default=True),
    )
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn_config(create_app(settings, owns_process=True), settings, log_level=log_level)
    server = uvicorn.Server(config)
    click.echo(f"idlegrid coordinator listening on http://{host}:{bound}", err=False)
    click.echo(
        f"admin token: {settings.admin_token_file} (read it with: cat {settings.admin_token_file})"
    )
    click.echo(f"replicas of a shard: {replica_rule(settings)}")
    click.echo(f"peer-to-peer training: {p2p_plan(settings)}")
    sys.stdout.flush()
    _run_profiled(lambda: server.run(sockets=[sock]), os.environ.get("IDLEGRID_PROFILE", ""))


def _flag(variable: str, given: bool | None, *, default: bool) -> bool:
    """A flag given on the command line, else its environment variable, else `default`."""
    if given is not None:
        return given
    raw = os.environ.get(variable, "")
    return raw.lower() in {"1", "true", "yes", "on"} if raw else default


def p2p_plan(settings: Any) -> str:
    """Whether a bootstrap DHT peer will listen, and where, with the settings that change it."""
    if settings.p2p_peers:
        return f"the DHT at {', '.join(settings.p2p_peers)} (IDLEGRID_P2P_PEERS); no port here"
    if settings.p2p == "off":
        return "off (--p2p off): no bootstrap DHT peer, no port"
    port = settings.p2p_port or "any free port"
    where = f"{settings.p2p_listen_host}, {port}"
    if settings.p2p == "auto":
        return (
            f"a bootstrap DHT peer will listen on {where} if hivemind is installed (its "
            "address is logged when it listens; --p2p-host, --p2p-port; --p2p off: none)"
        )
    return f"a bootstrap DHT peer will listen on {where} (--p2p-host, --p2p-port)"


def replica_rule(settings: Any) -> str:
    """The replica rule a coordinator keeps, in words, with the setting that changes it."""
    if not settings.distinct_networks:
        networks = "any networks (--replica-networks shared)"
    elif settings.network_prefix_v4 >= 32 and settings.network_prefix_v6 >= 128:
        networks = "distinct addresses (--replica-networks address)"
    else:
        networks = (
            f"distinct networks (IPv4 /{settings.network_prefix_v4}, IPv6 "
            f"/{settings.network_prefix_v6}); one network: --replica-networks shared"
        )
    accounts = "distinct accounts" if settings.distinct_accounts else "any accounts"
    return f"distinct nodes, {accounts}, {networks}"


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


@main.command("web-account")
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(["volunteer", "researcher", "admin"]),
    default="researcher",
    show_default=True,
)
@click.option("--email", default=None, help="Its email address (it may sign in with it too).")
@click.option(
    "--password-file",
    type=click.File("r"),
    default=None,
    help="Read the password from this file ('-': standard input); else prompt.",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    envvar="IDLEGRID_DATA_DIR",
    default=Path("./idlegrid-data"),
    show_default=True,
)
@click.option("--database", envvar="IDLEGRID_DATABASE_URL", default="", help="Database URL.")
@click.option(
    "--create",
    is_flag=True,
    help="Make a new SQLite database in --data-dir if it has none (else that is an error).",
)
def web_account(
    name: str,
    role: str,
    email: str | None,
    password_file: Any,
    data_dir: Path,
    database: str,
    create: bool,
) -> None:
    """Give an account (made if missing) a dashboard password and a role.

    The operator's way in: e.g. `idlegrid web-account admin --role admin` lets the
    bootstrap admin sign in to the dashboard. It changes the coordinator's own
    database: --data-dir (or --database) must be the one `idlegrid serve` uses.
    """
    from idlegrid.dashboard.accounts import set_login
    from idlegrid.settings import CoordinatorSettings
    from idlegrid.store import open_store

    settings = CoordinatorSettings.from_env(data_dir=data_dir, database_url=database or None)
    where = settings.database_url or str(settings.data_dir / "idlegrid.db")
    if not settings.database_url:
        if not (settings.data_dir / "idlegrid.db").exists() and not create:
            raise click.ClickException(
                f"no coordinator database at {where}: give the --data-dir that "
                "`idlegrid serve` uses (or IDLEGRID_DATA_DIR), or --create to make a new one"
            )
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    if password_file is not None:
        password = password_file.readline().rstrip("\n")
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)

    async def run() -> None:
        store = open_store(settings.database)
        try:
            await store.open()
            await set_login(store, name, email=email, password=password, role=role)  # type: ignore[arg-type]
        finally:
            await store.close()

    try:
        asyncio.run(run())
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name} may sign in to the dashboard as a {role} (database: {where})")


# -- worker ---------------------------------------------------------------------------------


from idlegrid.worker.commands import (  # noqa: E402  (its own module: a command group)
    DEFAULT_STATE_DIR,
    state_dir_option,
    worker,
)

main.add_command(worker)


@main.command(name="app")
@state_dir_option
def app_window(state_dir: Path | None) -> None:
    """Open the local worker's control page in a native window (the desktop's app)."""
    from idlegrid.worker.window import open_window

    open_window(state_dir or DEFAULT_STATE_DIR)


# -- researcher and admin commands (cli/researcher.py) -------------------------------------

for _command in COMMANDS:
    main.add_command(_command)


@main.command()
@click.option(
    "--kind",
    type=click.Choice(["embed-text", "onnx-infer", "llm-generate"]),
    default="embed-text",
    show_default=True,
    help="embed-text: paragraphs through all-MiniLM-L6-v2; onnx-infer: images through a "
    "small convolutional network on ONNX Runtime; llm-generate: chat prompts through "
    "SmolLM2-135M on llama.cpp, each shard checked by a prefill on another node.",
)
@click.option("--prompts", default=36, show_default=True, help="Prompts (llm-generate).")
@click.option("--max-tokens", default=32, show_default=True, help="Per prompt (llm-generate).")
@click.option("--texts", default=2000, show_default=True, help="Texts to embed.")
@click.option("--images", default=500, show_default=True, help="Images (onnx-infer).")
@click.option(
    "--workers", default=0, help="Local worker processes (default: as many as replication)."
)
@click.option(
    "--replication", default=3, show_default=True, help="Replicas per shard, verified by quorum."
)
@click.option("--shard-size", default=128, show_default=True)
@click.option(
    "--keep", is_flag=True, help="Keep the grid running for the dashboard; Ctrl-C stops it."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="The coordinator's port on 127.0.0.1; 0: any free one (printed).",
)
def demo(
    kind: str,
    texts: int,
    images: int,
    prompts: int,
    max_tokens: int,
    workers: int,
    replication: int,
    shard_size: int,
    keep: bool,
    port: int,
) -> None:
    """Run the whole grid on this machine: a coordinator, workers, a real job.

    Each worker is a volunteer with its own account; every shard runs on `replication`
    of them and a quorum decides its result. embed-text embeds paragraphs of the standard
    library's docstrings and checks every vector against a local reference (cosine >=
    0.999); onnx-infer runs drawn images (PNG and JPEG files) through a convolutional
    network and checks every row against ONNX Runtime run here. Both print the
    throughput and stop everything they started. llm-generate prints tokens per second,
    the check's cost against the generation's, and the credit each node earned.
    """
    from idlegrid.devtools.demo import run_demo, run_onnx_demo

    if kind == "llm-generate":
        from idlegrid.devtools.llm_demo import run_llm_demo

        sys.exit(run_llm_demo(prompts=prompts, workers=workers, max_tokens=max_tokens,
                              keep=keep, port=port))  # fmt: skip
    if kind == "onnx-infer":
        sys.exit(
            run_onnx_demo(
                images=images,
                workers=workers,
                replication=replication,
                shard_size=shard_size,
                keep=keep,
                port=port,
            )
        )
    sys.exit(
        run_demo(
            texts=texts,
            workers=workers,
            replication=replication,
            shard_size=shard_size,
            keep=keep,
            port=port,
        )
    )


if __name__ == "__main__":
    main()
