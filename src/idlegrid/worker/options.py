"""The worker command's shared pieces: the state directory option, the daemon's settings
from the command line's options, and the node token (worker/commands.py,
worker/app_commands.py). Only click is imported here: the daemon loads when it runs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import click

DEFAULT_STATE_DIR = Path.home() / ".idlegrid" / "worker"

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    envvar="IDLEGRID_STATE_DIR",
    help="Node identity, blob cache, benchmark, controls (default ~/.idlegrid/worker).",
)


def default_name(state_dir: Path | None) -> str:
    """The machine's name; with a state directory of its own (a second worker on one
    host), the machine's name and that directory's, so the dashboard tells them apart."""
    host = socket.gethostname()
    if state_dir is None or state_dir.resolve() == DEFAULT_STATE_DIR.resolve():
        return host
    return f"{host}-{state_dir.resolve().name}"


def _settings(options: dict[str, Any]) -> Any:
    from idlegrid.settings import WorkerSettings

    servers = tuple(part for s in options["servers"] for part in s.split(",") if part)
    battery = options["run_on_battery"]
    return WorkerSettings.from_env(
        servers=servers,
        token=options["token"],
        state_dir=options["state_dir"],
        name=options["name"] or default_name(options["state_dir"]),
        slots=options["slots"],
        prefetch=options["prefetch"],
        kinds=tuple(k for k in options["kinds"].split(",") if k) or None,
        device=options["device"] or None,
        threads=options["threads"] or None,
        benchmark=options["benchmark"],
        rebenchmark=options["rebenchmark"],
        pause_on_battery=None if battery is None else not battery,
        exclusive_apps=tuple(options["exclusive_apps"]) or None,
        idle_probes=tuple(options["idle_probes"]) or None,
        **{
            name: options[name]
            for name in (
                "dedicated",
                "cpu_mode",
                "gpu_mode",
                "idle_after_s",
                "cpu_cores",
                "cpu_percent",
                "in_use_cpu_percent",
                "memory_percent",
                "suspend_cpu_usage",
                "suspend_gpu_usage",
                "min_battery_percent",
                "windows",
                "max_cpu_temp_c",
                "daily_download_mb",
                "control_port",
                "p2p_reachability",
                "sequences",
            )
        },  # fmt: skip
    )


def make_worker(options: dict[str, Any]) -> Any:
    """The daemon (`worker.daemon.Worker`) from the group's options, logging set up."""
    from idlegrid.logs import setup_logging
    from idlegrid.worker.daemon import Worker

    token_file = options.pop("token_file", None)
    if not options["token"] and token_file is None:
        options["token"] = _installed_token(options["state_dir"] or DEFAULT_STATE_DIR)
    options["token"] = _node_token(options["token"] or "", token_file)
    setup_logging(options["log_level"])
    try:
        return Worker(_settings(options))
    except ValueError as exc:  # SettingError too: it names the setting
        raise click.UsageError(str(exc)) from None


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


def _installed_token(state_dir: Path) -> str | None:
    """The token `idlegrid worker install` kept in the state directory, if any."""
    from idlegrid.worker.service import TOKEN_FILE

    try:
        return (state_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def _state_dir(ctx: click.Context) -> Path:
    return (ctx.obj or {}).get("state_dir") or DEFAULT_STATE_DIR
