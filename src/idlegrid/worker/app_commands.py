"""`idlegrid worker deliver | tray | app`: the commands a package and a desktop run.

idlegrid worker deliver        deliver the outbox's finished results, then stop
idlegrid worker tray           the tray icon: state, pause, resume, snooze, open
idlegrid worker app            the local control page in a window of its own
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import click

from idlegrid.worker.options import DEFAULT_STATE_DIR, _state_dir, make_worker


def waiting_results(state_dir: Path) -> int:
    """Finished tasks in the outbox that the coordinator has not acknowledged yet."""
    return len(list((state_dir / "outbox").glob("*.json")))


@click.command()
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to try for.")
@click.pass_context
def deliver(ctx: click.Context, timeout: float) -> None:
    """Deliver the finished results waiting in the outbox, take no task, then stop.

    Run before the worker is removed (the package's pre-removal step does): results the
    coordinator cannot take now stay in the outbox, and the command says so and exits 1.
    """
    options: dict[str, Any] = dict(ctx.obj or {})
    state_dir = options["state_dir"] or DEFAULT_STATE_DIR
    waiting = waiting_results(state_dir)
    if not waiting:
        click.echo("no finished results are waiting to be delivered")
        return
    click.echo(f"delivering {waiting} finished result(s) to {', '.join(options['servers'])}")
    options.update(benchmark=False, control_port=-1, dedicated=True, slots=1, prefetch=0)
    node = make_worker(options)
    node.deliver_only()
    with contextlib.suppress(TimeoutError):  # what is left stays in the outbox
        asyncio.run(asyncio.wait_for(node.run(), timeout))
    left = waiting_results(state_dir)
    if left:
        click.echo(
            f"kept {left} finished result(s) in {state_dir / 'outbox'}: the coordinator did "
            "not take them; a worker started with this state directory delivers them"
        )
        ctx.exit(1)
    click.echo(f"delivered {waiting} finished result(s)")


@click.command()
@click.option("--every", default=2.0, show_default=True, help="Seconds between status reads.")
@click.pass_context
def tray(ctx: click.Context, every: float) -> None:
    """The tray icon: the worker's state and reason; pause, resume, snooze 1 h, open."""
    from idlegrid.worker.tray import run_tray

    run_tray(_state_dir(ctx), every=every)


@click.command()
@click.pass_context
def app(ctx: click.Context) -> None:
    """The local control page in a native window (pywebview)."""
    from idlegrid.worker.window import open_window

    open_window(_state_dir(ctx))
