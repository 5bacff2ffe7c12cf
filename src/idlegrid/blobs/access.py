"""Who may read and write a blob by its hash (docs/security.md, "Who may read what").

- An admin reads everything.
- A researcher reads the blobs their account uploaded and what their jobs produced.
- A node reads a blob only while a task of its account names it (a shard's payload, a
  job's input, a training round's weights or update), and for `blob_grace_s` after.
- A node uploads only while it holds a task (its output), and for `blob_grace_s` after.

A blob one may not read is answered as missing, so its existence stays private.
"""

from __future__ import annotations

import enum

from idlegrid.store import Store
from idlegrid.store.base import TokenInfo


class Basis(enum.Enum):
    """What a caller's access to a blob rests on."""

    EVERYTHING = "everything"  # an admin; a researcher uploading
    OWNED = "owned"  # uploaded by the account, or produced by its jobs
    TASKS = "tasks"  # named by (or the output of) a task its nodes hold


def read_basis(token: TokenInfo) -> Basis:
    if token.is_admin:
        return Basis.EVERYTHING
    return Basis.TASKS if token.kind == "node" else Basis.OWNED


def write_basis(token: TokenInfo) -> Basis:
    if token.is_admin or token.kind != "node":
        return Basis.EVERYTHING
    return Basis.TASKS


async def may_read(
    store: Store, token: TokenInfo, blob_hash: str, *, now: float, grace_s: float
) -> bool:
    """Whether the token's holder may read (or learn of) the blob."""
    match read_basis(token):
        case Basis.EVERYTHING:
            return True
        case Basis.OWNED:
            return await store.blob_owners.owns_or_produced(token.account_id, blob_hash)
        case Basis.TASKS:
            return await store.blob_owners.tasks_name(
                token.account_id, blob_hash, since=now - grace_s
            )


async def may_write(store: Store, token: TokenInfo, *, now: float, grace_s: float) -> bool:
    """Whether the token's holder may upload a blob now."""
    if write_basis(token) is Basis.EVERYTHING:
        return True
    return await store.blob_owners.holds_tasks(token.account_id, since=now - grace_s)
