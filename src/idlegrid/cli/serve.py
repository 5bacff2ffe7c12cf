"""`idlegrid serve`: run the coordinator, and say in words what it listens on and keeps."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from idlegrid.logs import setup_logging

if TYPE_CHECKING:
    from idlegrid.settings import CoordinatorSettings


@click.command()
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
    from idlegrid.settings import REPLICA_NETWORKS, CoordinatorSettings

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
    _run_coordinator(settings, host=host, port=port, log_level=log_level)


def _run_coordinator(
    settings: CoordinatorSettings, *, host: str, port: int, log_level: str
) -> None:
    """Bind the port, print where the coordinator listens and what it keeps, and serve."""
    import uvicorn

    from idlegrid.app import create_app
    from idlegrid.coordinator.serving import uvicorn_config

    setup_logging(log_level)
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
