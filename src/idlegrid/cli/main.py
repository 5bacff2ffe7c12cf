"""The `idlegrid` command line: run a coordinator or a worker, submit and follow jobs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from idlegrid import __version__
from idlegrid.cli.researcher import COMMANDS
from idlegrid.cli.serve import serve


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


# -- the coordinator: serve (cli/serve.py), migrate, web-account ---------------------------

main.add_command(serve)


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
