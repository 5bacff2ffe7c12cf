"""The researcher's and the admin's commands of `idlegrid`: submit and follow jobs, fetch
results, manage tokens. Each talks to a coordinator through the SDK (`idlegrid.client`)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click

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
json_option = click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")


def _client(server: str, token: str) -> Any:
    import logging

    from idlegrid.cli.progress import UploadProgress
    from idlegrid.client import Client

    # The SDK logs its submission warnings; the CLI prints them itself, once.
    logging.getLogger("idlegrid.client").addHandler(logging.NullHandler())

    # Named in the one-line error of a failure (see errors.explain).
    ctx = click.get_current_context()
    ctx.find_root().meta["idlegrid.server"] = server
    client = Client(server, token, upload_progress=UploadProgress())
    ctx.call_on_close(client.close)
    return client


def _console() -> Any:
    from rich.console import Console

    return Console()


# -- submit -------------------------------------------------------------------------------


@click.command()
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
@click.option(
    "--replication",
    type=click.IntRange(1, 16),
    default=None,
    help="Replicas per shard (default: the coordinator's, 3); 1 for a single worker.",
)
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--wait/--no-wait", default=None, help="Wait with a progress bar.")
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="Save the result here (waits for it); with --model, the trained model's folder.",
)
@click.option(
    "--model",
    "model_source",
    type=click.Path(path_type=Path, exists=True),
    default=None,
    help="diloco-train: a Hugging Face folder or a .gguf file to train (hf-causal-lm).",
)
@click.option(
    "--text",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="diloco-train with --model: a UTF-8 text file, tokenized with the model's tokenizer.",
)
@server_option
@token_option
def submit(
    kind: str,
    inputs: tuple[str, ...],
    params: tuple[str, ...],
    replication: int | None,
    priority: int,
    wait: bool | None,
    output: Path | None,
    model_source: Path | None,
    text: Path | None,
    server: str,
    token: str,
) -> None:
    """Submit a job: KIND and its inputs as NAME=PATH, or PATHs in the kind's input order.

    \b
    Kinds, their inputs, and an example of each:
    embed-text    texts: JSON Lines, a string or {"text": ...} a line
      idlegrid submit embed-text texts.jsonl --wait -o vectors.npy
    onnx-infer    model (.onnx), data (.safetensors, .npy or a folder of images)
      idlegrid submit onnx-infer model.onnx data.safetensors \\
          --wait -o out.safetensors
    llm-generate  model (.gguf), prompts: JSON Lines, {"prompt": ...} or
                  {"messages": [...]} a line, or OpenAI Batch API lines
      idlegrid submit llm-generate model.gguf prompts.jsonl \\
          -p max_tokens=128 --wait -o answers.jsonl
    diloco-train  a model (--model: a Hugging Face folder or a .gguf) and
                  --text, or a dataset of token ids (.safetensors)
      idlegrid submit diloco-train --model SmolLM2/ --text notes.txt \\
          -p rounds=4 -p 'model={"lora": {"rank": 8}}' -o SmolLM2-tuned/
    vectors       no input: a fixed network's vectors (checks, benchmarks)
      idlegrid submit vectors -p items=1000 -p shard_size=100
    sleep, noop   no input: shards that wait, or do nothing (tests)
      idlegrid submit sleep -p tasks=20 -p seconds=0.5

    A folder as onnx-infer's data is its .jpg/.jpeg/.png files, in name order,
    with -p 'preprocess={...}'. Each kind's settings (-p): docs/onnx.md,
    docs/llm-generate.md, docs/training.md; a wrong one is refused with its name.
    """
    if output is not None and wait is False:
        raise click.UsageError("-o/--output saves the result once the job ends: drop --no-wait")
    if model_source is not None or text is not None:
        _train(kind, model_source, text, inputs, params, replication, priority, wait, output,
               server, token)  # fmt: skip
        return
    _submit_inputs(kind, inputs, params, replication, priority, wait, output, server, token)


def _submit_inputs(
    kind: str,
    inputs: tuple[str, ...],
    params: tuple[str, ...],
    replication: int | None,
    priority: int,
    wait: bool | None,
    output: Path | None,
    server: str,
    token: str,
) -> None:
    """`submit KIND INPUTS`: the kind's input files as they are, the result saved as a file."""
    from idlegrid.kinds import UnknownKind, get_kind

    try:
        names = get_kind(kind).input_names
    except UnknownKind as exc:
        raise click.BadParameter(str(exc), param_hint="KIND") from None
    files = _input_files(inputs, names)
    settings = _parse_params(params)
    data = {name: _input_bytes(path) for name, path in files.items()}
    client = _client(server, token)
    job = client.submit(
        kind, inputs=data, params=settings, replication=replication, priority=priority
    )
    click.echo(f"job {job.id} submitted")
    for warning in job.warnings:
        click.echo(f"warning: {warning}", err=True)
    if wait or output is not None:
        _wait(job)
        if output is not None:
            _write(output, job.result_bytes())
            click.echo(f"result saved to {output}")


def _train(
    kind: str,
    model_source: Path | None,
    text: Path | None,
    inputs: tuple[str, ...],
    params: tuple[str, ...],
    replication: int | None,
    priority: int,
    wait: bool | None,
    output: Path | None,
    server: str,
    token: str,
) -> None:
    """`submit diloco-train --model DIR --text FILE`: a researcher's model, saved as a folder."""
    if kind != "diloco-train" or model_source is None:
        raise click.UsageError("--model and --text go with diloco-train, --model always")
    if (text is None) == (not inputs):
        raise click.UsageError("give the training data once: --text FILE or a dataset file")
    dataset = text if text is not None else Path(inputs[0].partition("=")[2] or inputs[0])
    client = _client(server, token)
    job = client.train(model_source, dataset=dataset, params=_parse_params(params),
                       replication=replication, priority=priority)  # fmt: skip
    click.echo(f"job {job.id} submitted")
    for warning in job.warnings:
        click.echo(f"warning: {warning}", err=True)
    if wait or output is not None:
        _wait(job)
        if output is not None:
            job.save(output)
            click.echo(f"model saved to {output}/")


def _wait(job: Any) -> None:
    """Wait with progress; Ctrl-C leaves the job running and says how to follow it."""
    try:
        job.wait(progress=True)
    except KeyboardInterrupt:
        click.echo(f"\njob {job.id} goes on; follow it with: idlegrid job {job.id} --watch")
        raise SystemExit(130) from None


def _write(path: Path, data: bytes) -> None:
    """Write a result; a failed write names the file (the OS error of a write does not)."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def _parse_params(params: tuple[str, ...]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for item in params:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="-p")
        try:
            settings[key.strip()] = json.loads(raw)
        except ValueError:
            settings[key.strip()] = raw  # a plain word: a string
    return settings


def _input_bytes(path: Path) -> bytes:
    """A file's bytes; a folder is its images, zipped in name order (with a progress bar)."""
    if not path.is_dir():
        return path.read_bytes()
    from rich.progress import Progress

    from idlegrid.kinds.onnx.data import IMAGE_SUFFIXES, zip_files

    found = sorted(p for p in path.iterdir() if p.name.lower().endswith(IMAGE_SUFFIXES))
    if not found:
        raise click.BadParameter(f"{path} holds no .jpg, .jpeg or .png file")
    with Progress() as progress:
        bar = progress.add_task(f"reading {len(found)} images", total=len(found))
        return zip_files(found, on_file=lambda: progress.advance(bar))


def _input_files(inputs: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Path]:
    positional = [item for item in inputs if "=" not in item]
    if (positional and len(positional) != len(inputs)) or len(positional) > len(names):
        raise click.BadParameter(
            f"this kind takes inputs {list(names)}: give them in that order, or as NAME=PATH"
        )
    if positional:
        return {name: Path(item) for name, item in zip(names, positional, strict=False)}
    files: dict[str, Path] = {}
    for item in inputs:
        name, _, path = item.partition("=")
        if name not in names:
            raise click.BadParameter(f"unknown input {name!r}; this kind takes {list(names)}")
        files[name] = Path(path)
    return files


# -- jobs, job, metrics, results ----------------------------------------------------------


@click.command()
@click.option("--limit", default=20, show_default=True)
@json_option
@server_option
@token_option
def jobs(limit: int, as_json: bool, server: str, token: str) -> None:
    """List your jobs, newest first."""
    from rich import box
    from rich.table import Table

    found = _client(server, token).jobs(limit=limit)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    table = Table("id", "kind", "state", "shards", "items", "error", box=box.SIMPLE)
    for job in found:
        table.add_row(
            str(job["id"]),
            job["kind"],
            job["state"],
            f"{job['shards_done']}/{job['shards_total']}",
            str(job["items_total"]),
            (job["error"] or "")[:40],
        )
    _console().print(table)


@click.command()
@click.argument("job_id", type=int)
@click.option("--watch", is_flag=True, help="Follow progress until the job ends.")
@click.option("--cancel", is_flag=True, help="Cancel the job.")
@click.option(
    "--resubmit",
    is_flag=True,
    help="Submit again only the shards of this failed or cancelled job that did not "
    "complete, as a new job (shown instead).",
)
@json_option
@server_option
@token_option
def job(
    job_id: int,
    watch: bool,
    cancel: bool,
    resubmit: bool,
    as_json: bool,
    server: str,
    token: str,
) -> None:
    """Show one job: state, progress, times, what it waits for, its shards.

    --watch follows it until it ends (exit code 1 if it fails or is cancelled).
    """
    from idlegrid.cli import summary
    from idlegrid.client import JobFailed

    handle = _client(server, token).job(job_id)
    if cancel:
        handle.cancel()
    if resubmit:
        handle = handle.resubmit()
    ended_badly = False
    if watch:
        try:
            _wait(handle)
        except JobFailed:
            ended_badly = True  # shown in the summary below
    info = handle.info(shards=True)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        shards = info.get("shards") or []
        click.echo("\n".join(summary.job_lines(info) + summary.shard_lines(shards)))
    if ended_badly:
        sys.exit(1)


@click.command()
@click.argument("job_id", type=int)
@click.option("--watch", is_flag=True, help="Follow training with progress bars until it ends.")
@json_option
@server_option
@token_option
def metrics(job_id: int, watch: bool, as_json: bool, server: str, token: str) -> None:
    """Per-round metrics of a training job (losses, bytes up and down, time, nodes)."""
    from idlegrid.cli import summary
    from idlegrid.client import JobFailed

    with _client(server, token) as client:
        handle = client.job(job_id)
        if watch:
            with contextlib.suppress(JobFailed):  # a failed job still has its metrics
                _wait(handle)
        found = handle.metrics()
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    _console().print(summary.rounds_table(found))
    stale = ""
    if found.get("asynchronous"):
        stale = (f", stale updates {found['stale_applied']} applied, "
                 f"{found['stale_dropped']} dropped")  # fmt: skip
    click.echo(
        f"job {job_id} {found['state']}: {found['rounds_done']}/{found['rounds_total']} "
        f"rounds, {summary.size(found['bytes_up'])} up, {summary.size(found['bytes_down'])} down"
        f"{stale}"
    )


@click.command()
@click.argument("job_id", type=int)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="File to write (embed-text: a .npy float32 array).",
)
@server_option
@token_option
def results(job_id: int, output: Path, server: str, token: str) -> None:
    """Download a completed job's result."""
    data = _client(server, token).job(job_id).result_bytes()
    _write(output, data)
    click.echo(f"{len(data)} bytes written to {output}")


# -- tokens -------------------------------------------------------------------------------


@click.group()
def token() -> None:
    """Manage API and node tokens: create, list, revoke."""


@token.command("create")
@click.option("--node", "is_node", is_flag=True, help="A node token (for `idlegrid worker`).")
@click.option(
    "--account",
    default=None,
    help="Admin only: for this account (made if new); a volunteer's own account.",
)
@click.option("--label", default="", help="A note to remember the token by.")
@server_option
@token_option
def token_create(is_node: bool, account: str | None, label: str, server: str, token: str) -> None:
    """Create a token; it is shown once and stored only as a hash.

    \b
    idlegrid token create --node --account alice   # for alice's worker: credit goes to alice
    idlegrid token create --account bob            # a researcher token for bob
    """
    made = _client(server, token).create_token(
        kind="node" if is_node else "api", label=label, account=account
    )
    click.echo(made["token"])
    note = f"{made['kind']} token {made['id']} for account {made['account']}, shown only now"
    if is_node:
        note += (
            "; on the volunteer's machine keep it in a file only they can read "
            "(chmod 600) and run: idlegrid worker --server URL --token-file FILE"
        )
    click.echo(f"({note})", err=True)


@token.command("list")
@click.option("--account", default=None, help="Admin only: this account's tokens.")
@click.option("--all", "all_accounts", is_flag=True, help="Admin only: every account's tokens.")
@click.option("--revoked", is_flag=True, help="Show revoked tokens too.")
@json_option
@server_option
@token_option
def token_list(
    account: str | None, all_accounts: bool, revoked: bool, as_json: bool, server: str, token: str
) -> None:
    """List tokens by id and prefix (their secrets are never stored)."""
    from idlegrid.cli import summary

    found = _client(server, token).tokens(
        account=account, all_accounts=all_accounts, revoked=revoked
    )
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    _console().print(summary.tokens_table(found))


@token.command("revoke")
@click.argument("token_id", type=int)
@server_option
@token_option
def token_revoke(token_id: int, server: str, token: str) -> None:
    """Revoke a token by its id (see `idlegrid token list`); it stops working at once.

    A worker already connected with a revoked node token keeps its connection until it
    drops; it cannot connect again.
    """
    revoked = _client(server, token).revoke_token(token_id)
    click.echo(f"revoked {revoked['kind']} token {token_id} ({revoked['prefix']}...) "
               f"of account {revoked['account']}")  # fmt: skip


from idlegrid.cli.model import model  # noqa: E402  (its own module: a command group)

COMMANDS = (submit, jobs, job, metrics, results, token, model)
