"""Who wrote a round's records in the DHT: members and the coordinator, never a stranger.

The DHT is open: anyone who reaches the coordinator's bootstrap peer can join it, and a
round's keys are easy to guess. A stranger who wrote a meeting entry under a member's
shard (its own peer id), or a retry decision, would have members send it their parts and
take its answers as the group's mean: every member would agree on the poisoned mean.

So each round's group carries a secret, which the coordinator derives from its own key
(`round_secret`) and hands only to the round's members, in their tasks. Every record of
the round (a member's entry, its request for a retry group, the coordinator's decision)
is sealed with an HMAC of the secret over the record and the place it is written
(`seal`); readers take only records whose seal holds for that place (`opened`), so a
record cannot be forged or moved to another shard, meeting or round. The coordinator's
namer, which holds the key, derives each round's secret from the group's key.

What a stranger can still do is write over a record (the DHT keeps the value that
expires last) and so hide it: the meeting then fails and the round falls back to the
coordinator, which is slower, not wrong. Members' streams are libp2p's, authenticated by
peer id, and a reducer takes a part for a shard only from the peer the sealed meeting
named for it (`allreduce`).

Pure: no torch, no hivemind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KEY_BYTES = 32
_FIELD = "mac"


def round_secret(key: bytes, group_key: str) -> str:
    """The secret of the round whose group key is `group_key` (hex), from the coordinator's
    `key`; "" without a key (records are then neither sealed nor checked)."""
    if not key:
        return ""
    return hmac.new(key, b"idlegrid-p2p-round\0" + group_key.encode(), hashlib.sha256).hexdigest()


def seal(record: Mapping[str, Any], secret: str, where: str) -> dict[str, Any]:
    """`record` with its seal for `where` (the DHT key and subkey it is written under)."""
    body = {k: v for k, v in record.items() if k != _FIELD}
    if not secret:
        return body
    return {**body, _FIELD: _mac(secret, where, body)}


def opened(record: Any, secret: str, where: str) -> dict[str, Any] | None:
    """The record without its seal if the seal holds for `where`; None if it does not (or
    the record is not a mapping). Without a secret every mapping is taken as it is."""
    if not isinstance(record, Mapping):
        return None
    body = {k: v for k, v in record.items() if k != _FIELD}
    if not secret:
        return body
    given = record.get(_FIELD)
    if not isinstance(given, str) or not hmac.compare_digest(given, _mac(secret, where, body)):
        return None
    return body


def _mac(secret: str, where: str, body: Mapping[str, Any]) -> str:
    try:
        raw = json.dumps([where, body], sort_keys=True, separators=(",", ":"))
        return hmac.new(bytes.fromhex(secret), raw.encode(), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):  # not JSON, or not a hex secret: nothing can match
        return "!"


def load_key(path: Path) -> bytes:
    """The coordinator's round key, kept in `path` (made, readable by its owner only, on
    first use), so that rounds handed out before a restart stay verifiable after it."""
    try:
        key = path.read_bytes()
        if len(key) == KEY_BYTES:
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(KEY_BYTES)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(b"")
    partial.chmod(0o600)
    partial.write_bytes(key)
    partial.replace(path)
    return key
