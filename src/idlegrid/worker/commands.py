"""`idlegrid worker`: run the daemon, or talk to the one running on this machine.

    idlegrid worker --server URL --token T        run a worker node (the daemon)
    idlegrid worker --show-idle                   each idle probe and its reading
    idlegrid worker status | pause | resume | finish | snooze
    idlegrid worker install | uninstall           autostart as a service
    idlegrid worker idle-helper                   the user-session idle helper

The subcommands reach the daemon through its control page (127.0.0.1, the token file in
the state directory). Only click is imported here: the daemon loads when it runs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from idlegrid.worker import app_commands
from idlegrid.worker.options import (
    DEFAULT_STATE_DIR,
    _node_token,
    _state_dir,
    default_name,
    make_worker,
    state_dir_option,
)

__all__ = ["DEFAULT_STATE_DIR", "default_name", "state_dir_option", "worker"]


def _policy_options(command: Any) -> Any:
    """The idle policy's flags (each also an IDLEGRID_* variable; docs/worker.md)."""
    options = [
        click.option("--dedicated", is_flag=True, default=None,
                     help="Compute always at full speed, whatever the machine is doing."),
        click.option("--cpu-mode", type=click.Choice(["always", "idle", "never"]), default=None,
                     help="When to use the CPU (default idle)."),
        click.option("--gpu-mode", type=click.Choice(["always", "idle", "never"]), default=None,
                     help="When to use the GPU (default idle)."),
        click.option("--idle-after", "idle_after_s", type=float, default=None,
                     help="Seconds without input before the machine counts as idle (180)."),
        click.option("--cpu-cores", type=int, default=None, help="Cores tasks may use (0: all)."),
        click.option("--cpu-percent", type=float, default=None,
                     help="CPU time of those cores while idle, 1-100 (100)."),
        click.option("--in-use-cpu-percent", type=float, default=None,
                     help="CPU time while in use, with --cpu-mode always (50)."),
        click.option("--memory-percent", type=float, default=None,
                     help="RAM tasks may hold while idle, percent (90)."),
        click.option("--suspend-cpu-usage", type=float, default=None,
                     help="Pause while other programs use more CPU than this percent (25)."),
        click.option("--suspend-gpu-usage", type=float, default=None,
                     help="Pause GPU work while other programs use more of the GPU than "
                          "this percent (25)."),
        click.option("--exclusive-app", "exclusive_apps", multiple=True,
                     help="Pause while a program of this name runs (repeat)."),
        click.option("--run-on-battery", is_flag=True, default=None,
                     help="Do not pause on battery."),
        click.option("--min-battery-percent", type=float, default=None,
                     help="On battery, pause below this charge."),
        click.option("--windows", default=None,
                     help='Allowed times, e.g. "18:00-08:00; sat,sun 00:00-24:00".'),
        click.option("--max-cpu-temp", "max_cpu_temp_c", type=float, default=None,
                     help="Pause at or above this CPU temperature, °C."),
        click.option("--idle-probe", "idle_probes", multiple=True,
                     help="Use only this idle probe (repeat; see --show-idle)."),
        click.option("--daily-download-mb", type=float, default=None,
                     help="Input MB to download a day; past it, no new work (0: no cap)."),
        click.option("--control-port", type=int, default=None,
                     help="Local control page port (7390; 0: any free; -1: none)."),
        click.option("--p2p-reachability", type=click.Choice(["auto", "public", "client"]),
                     default=None, help="Peer-to-peer training: a full peer (public), "
                     "Hivemind's client mode behind NAT (client), or auto (default)."),
        click.option("--sequences", type=click.IntRange(1, 256), default=None,
                     help="LLM generation: prompts decoded together in one model context "
                     "(32; fewer where memory is short; 1: one after another)."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


@click.group(invoke_without_command=True)
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
    default=None,
    help="Node token (env IDLEGRID_NODE_TOKEN; better than the flag, which `ps` shows).",
)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="IDLEGRID_NODE_TOKEN_FILE",
    default=None,
    help="File holding the node token, readable by its owner only (chmod 600).",
)
@state_dir_option
@click.option("--name", default="", help="The node's name in `GET /v1/nodes` (default: host).")
@click.option("--slots", default=1, show_default=True, help="Tasks to run at once.")
@click.option(
    "--prefetch",
    default=1,
    show_default=True,
    help="Tasks to hold beyond the slots, started when one frees; their inputs download "
    "while the slots compute.",
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
@click.option("--show-idle", is_flag=True, help="Print each idle probe and its reading, then exit.")
@_policy_options
@click.option("--log-level", default="info", show_default=True)
@click.pass_context
def worker(ctx: click.Context, **options: Any) -> None:
    """Run a worker node: probe and benchmark this machine, then take tasks when idle.

    The worker connects out to the coordinator (works behind NAT), reconnects with
    backoff when it goes away, runs only built-in task kinds, and steps aside (suspends
    its tasks) as soon as the owner uses the machine. Ctrl-C once: finish the running
    tasks, then stop; twice (or SIGTERM): give them back to the coordinator and stop.
    Subcommands talk to a running one.
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = options
        return
    if options.pop("show_idle"):
        _show_idle(options["state_dir"] or DEFAULT_STATE_DIR)
        return
    _run_daemon(options)


def _run_daemon(options: dict[str, Any]) -> None:
    from idlegrid.worker.daemon import NodeRefused, OtherProtocol

    node = make_worker(options)
    try:
        asyncio.run(_serve(node))
    except OtherProtocol as exc:
        raise click.ClickException(str(exc)) from None
    except NodeRefused as exc:
        raise click.ClickException(f"{exc} (make one: idlegrid token create --node)") from None


async def _serve(node: Any) -> None:
    """Run until stopped. The first Ctrl-C (SIGINT) finishes the running tasks, the second
    gives them back and stops. SIGTERM gives them back and stops at once: a service
    manager or a shutdown that sends it kills what is left soon after, and a task given
    back goes to another node now instead of when its lease expires."""
    loop = asyncio.get_running_loop()
    owned: set[asyncio.Task[None]] = set()
    asked = 0

    def start(step: Any) -> None:
        task = loop.create_task(step)
        owned.add(task)
        task.add_done_callback(owned.discard)

    def on_interrupt() -> None:
        nonlocal asked
        asked += 1
        if asked == 1:
            click.echo(
                "finishing the running tasks, then stopping (Ctrl-C again: give them back "
                "and stop now)",
                err=True,
            )
            start(node.finish())
        else:
            on_terminate()

    def on_terminate() -> None:
        click.echo("giving the running tasks back to the coordinator and stopping", err=True)
        start(node.give_back_and_stop())

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    loop.add_signal_handler(signal.SIGTERM, on_terminate)
    try:
        await node.run()
    finally:
        await asyncio.gather(*owned, return_exceptions=True)


def _show_idle(state_dir: Path) -> None:
    from idlegrid.worker.idle import IdleSource, default_probes
    from idlegrid.worker.idle.wayland import WaylandIdleProbe

    source = IdleSource(default_probes(state_dir))
    for probe in source.probes:
        if isinstance(probe, WaylandIdleProbe):  # its first reading takes one timeout
            probe.wait_ready()
    for reading in source.read_all():
        value = f"idle {reading.idle_s:.1f} s" if reading.idle_s is not None else "cannot tell"
        click.echo(
            f"{reading.probe:<20} {value}" + (f"  ({reading.detail})" if reading.detail else "")
        )
    chosen = source.read()
    click.echo(f"using: {chosen.probe}" if chosen.idle_s is not None else "using: none")


# -- talking to the running daemon ----------------------------------------------------------


def _call(state_dir: Path, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    from idlegrid.worker.local_client import LocalWorker, LocalWorkerError

    try:
        return LocalWorker(state_dir).call(method, path, body)
    except LocalWorkerError as exc:
        raise click.ClickException(str(exc)) from None


def _headline(status: dict[str, Any]) -> str:
    """The state and its reason, once: the policy's reasons say the state in words
    ("paused: user active 12 s ago", "running: idle for 5 min, within the limits...")."""
    state, reason = status["state"], status["reason"]
    return reason if reason.startswith(("running", "paused", "finishing")) else f"{state}: {reason}"


def _print_status(status: dict[str, Any]) -> None:
    click.echo(_headline(status))
    idle = status["idle"]
    seconds = "cannot tell" if idle["seconds"] is None else f"idle {idle['seconds']:.0f} s"
    click.echo(f"idle detection: {idle['probe']} ({seconds})")
    for task in status["tasks"]:
        click.echo(
            f"  task {task['task_id']} ({task['kind']}, job {task['job_id']}): "
            f"{task['state']}, {100 * task['progress']:.0f}%"
        )
    credit = "unknown" if status["credit"] is None else f"{status['credit']:.2f}"
    click.echo(
        f"completed {status['completed']}, waiting to report {status['outbox']}, credit {credit}"
    )


@worker.command()
@click.option("--json", "as_json", is_flag=True, help="The raw JSON status.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """The running worker's state, its reason, and its tasks."""
    state_dir = _state_dir(ctx)
    data = _call(state_dir, "GET", "/api/status")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    _print_status(data)
    from idlegrid.worker.local_client import LocalWorker

    click.echo(f"control page: {LocalWorker(state_dir).page_url()}")


def _action(name: str, help_text: str) -> None:
    @worker.command(name=name, help=help_text)
    @click.pass_context
    def command(ctx: click.Context) -> None:
        data = _call(_state_dir(ctx), "POST", f"/api/{name}", {})
        click.echo(_headline(data))


_action("pause", "Pause now: running tasks are suspended, not lost.")
_action("resume", "Resume: compute again whenever the policy allows.")
_action("finish", "Finish the current tasks, take no new ones, then pause.")


@worker.command()
@click.option("--minutes", default=60.0, show_default=True)
@click.pass_context
def snooze(ctx: click.Context, minutes: float) -> None:
    """Pause for a while (an hour by default), then go back to the policy."""
    data = _call(_state_dir(ctx), "POST", "/api/snooze", {"seconds": minutes * 60})
    click.echo(_headline(data))


@worker.command(name="idle-helper")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between readings.")
@click.pass_context
def idle_helper(ctx: click.Context, interval: float) -> None:
    """Run in the owner's session: write its idle time for a worker running as a service."""
    from idlegrid.worker.idle import IdleSource, default_probes
    from idlegrid.worker.idle.desktop import HelperFileProbe, write_helper_reading

    state_dir = _state_dir(ctx)
    probes = [p for p in default_probes(state_dir) if not isinstance(p, HelperFileProbe)]
    source = IdleSource(probes)
    click.echo(f"writing idle readings to {state_dir}", err=True)
    while True:
        reading = source.read()
        if reading.idle_s is not None:
            write_helper_reading(state_dir, reading.idle_s, reading.probe)
        time.sleep(interval)


@worker.command()
@click.option("--system", is_flag=True, help="A system service (root) instead of the user's.")
@click.option("--dry-run", is_flag=True, help="Print the files; install nothing.")
@click.pass_context
def install(ctx: click.Context, system: bool, dry_run: bool) -> None:
    """Install and start the worker as a service with these options (systemd, launchd,
    Task Scheduler)."""
    from idlegrid.worker import service

    options = dict(ctx.obj or {})
    options["token"] = _node_token(options.get("token") or "", options.pop("token_file", None))
    try:
        done = service.install(options, system=system, dry_run=dry_run, platform=sys.platform)
    except service.ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    for line in done:
        click.echo(line)


@worker.command()
@click.option("--system", is_flag=True, help="The system service instead of the user's.")
def uninstall(system: bool) -> None:
    """Stop and remove the worker service."""
    from idlegrid.worker import service

    try:
        for line in service.uninstall(system=system, platform=sys.platform):
            click.echo(line)
    except service.ServiceError as exc:
        raise click.ClickException(str(exc)) from None


# The package's and the desktop's commands, in a module of their own.
for _command in (app_commands.deliver, app_commands.tray, app_commands.app):
    worker.add_command(_command)
