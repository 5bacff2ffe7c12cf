"""What the CLI prints for people: a job, a training job's rounds, tokens.

Times in local time, sizes in units, tables that fit an 80-column terminal. The raw
forms stay one `--json` away.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.table import Table

from idlegrid.cli.progress import waiting_note

SHARDS_SHOWN = 50
# Kinds whose shards are cut by tokens: their progress reads in tokens.
TOKEN_KINDS = ("llm-generate",)


def local_time(epoch: float | None) -> str:
    """An epoch timestamp as local date and time ('-' for none)."""
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def size(count: float | None) -> str:
    """Bytes in decimal units, at most 7 characters ('' for none)."""
    if count is None:
        return ""
    value = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def job_lines(info: dict[str, Any], *, now: float | None = None) -> list[str]:
    """A job as a person reads it: state, progress, replication, times, what it waits for."""
    now = time.time() if now is None else now
    done, total = info["shards_done"], info["shards_total"]
    lines = [
        f"job {info['id']}: {info['kind']}, {info['state']}",
        f"  progress     {done}/{total} shards ({info['progress']:.0%}), "
        f"{info['items_total']} items, {info['tasks_completed']} tasks run",
    ]
    if info["kind"] in TOKEN_KINDS and info.get("shards") is not None:
        lines.append(f"  tokens       {_tokens(info)}")
    estimate = info.get("estimate")
    if estimate:
        lines.append(
            f"  estimate     about {duration(estimate['seconds'])} left on "
            f"{estimate['nodes']} connected node(s) that can run it"
        )
    lines += [
        f"  replication  {_replication(info)}",
        f"  created      {local_time(info['created_at'])}",
    ]
    if info.get("started_at") is not None:
        lines.append(f"  started      {local_time(info['started_at'])}")
    if info.get("finished_at") is not None:
        took = info["finished_at"] - (info.get("started_at") or info["created_at"])
        lines.append(f"  finished     {local_time(info['finished_at'])} (took {duration(took)})")
    elif info["state"] in ("queued", "running"):
        lines.append(f"  running for  {duration(now - info['created_at'])}")
    if info.get("error"):
        lines.append(f"  error        {info['error']}")
    if info.get("result_size") is not None:
        lines.append(f"  result       {size(info['result_size'])} (idlegrid results {info['id']})")
    note = waiting_note(info)
    if note:
        lines.append(f"  {note}")
    counts = ", ".join(f"{n} {state}" for state, n in sorted(info["shard_counts"].items()))
    lines.append(f"  shards       {counts or 'none'}")
    return lines


def _tokens(info: dict[str, Any]) -> str:
    """A generation job's progress in tokens (prompt plus max_tokens, the unit its shards
    are cut by), running shards counted by their reported progress."""
    total = int(info["items_total"])
    done = int(sum(s["items"] * (1.0 if s["state"] == "done" else s["progress"])
                   for s in info["shards"]))  # fmt: skip
    share = done / total if total else 1.0
    return f"{done:,}/{total:,} tokens ({share:.0%}, prompt plus max_tokens)"


def _replication(info: dict[str, Any]) -> str:
    effective = info.get("effective_replication")
    text = f"{info['replication']} per shard"
    if effective is not None:
        text += f" (effective {effective:g} tasks per shard done)"
    return text


def shard_lines(shards: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"    #{s['index']:<5} {s['state']:<9} {s['items']:>6} items  "
        f"{s['attempts']} attempts  {s['live_tasks']} running  {s['progress']:.0%}"
        + (f"  {s['error']}" if s.get("error") else "")
        for s in shards[:SHARDS_SHOWN]
    ]
    if len(shards) > SHARDS_SHOWN:
        lines.append(f"    ... {len(shards) - SHARDS_SHOWN} more (--json shows all)")
    return lines


def rounds_table(metrics: dict[str, Any]) -> Table:
    """A training job's rounds, narrow enough for 80 columns."""
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold underline")
    for header in ("round", "train", "eval", "upd", "nodes", "up", "down", "time", "closed"):
        left = header in ("round", "closed")
        table.add_column(header, justify="left" if left else "right", no_wrap=True)
    for row in metrics["rounds"]:
        label = str(row["round"])
        if row["final"]:
            label += " end"
        elif row["state"] != "closed":
            label += f" {row['state']}"
        table.add_row(
            label,
            _loss(row["train_loss"]),
            _loss(row["eval_loss"]),
            "" if row["updates"] is None else str(row["updates"]),
            str(row["nodes"]),
            size(row["bytes_up"]),
            size(row["bytes_down"]),
            "" if row["round_time_s"] is None else f"{row['round_time_s']:.1f}s",
            row["closed_by"] or "",
        )
    return table


def _loss(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def tokens_table(found: list[dict[str, Any]]) -> Table:
    table = Table("id", "account", "kind", "prefix", "label", box=box.SIMPLE, pad_edge=False)
    for header in ("created", "revoked"):
        table.add_column(header, no_wrap=True)
    for row in found:
        table.add_row(
            str(row["id"]),
            row["account"],
            row["kind"],
            row["prefix"] + "...",
            row["label"],
            local_time(row["created_at"])[:16],  # to the minute: the table fits 80 columns
            local_time(row["revoked_at"])[:16] if row["revoked_at"] else "",
        )
    return table
