"""Peer-to-peer averaging through Hivemind: the `idlegrid[p2p]` extra.

A training round in `averaging: "p2p"` mode moves its bytes between the round's members,
not through the coordinator: each member averages its pseudo-gradient with the group the
coordinator named, meeting in Hivemind's DHT (`roster`) and all-reducing its parts,
compressed as uploads are, over Hivemind's p2p daemon (`parts`, `allreduce`, `attempts`).
Hivemind imports torch, so it runs only in child processes: the coordinator's bootstrap
DHT peer (`bootstrap`) and each worker's standing averager (`averaging`). What the parent
processes import here (`group`, `reachability`, `supervisor`, `averaging`'s member side,
`parts`, `unavailable`) needs neither torch nor hivemind.
"""

from __future__ import annotations

import importlib.util
import sys

# What a node lists among its kinds when it can average peer to peer.
CAPABILITY = "p2p"
# Hivemind's p2p daemon ships for these platforms only.
SUPPORTED_PLATFORMS = ("linux", "darwin")
# Seconds a DHT request waits for its answer before the peer counts as gone (Hivemind's
# default is 3): a busy volunteer machine answers slower, and a store or read that times
# out there fails a group whose members were all present.
DHT_REQUEST_TIMEOUT_S = 10.0


def unavailable() -> str | None:
    """Why this machine cannot average peer to peer; None when it can."""
    if not sys.platform.startswith(SUPPORTED_PLATFORMS):
        return f"peer-to-peer averaging runs on Linux and macOS only, not {sys.platform}"
    try:
        found = importlib.util.find_spec("hivemind") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        return "hivemind is not installed (pip install 'idlegrid[p2p]')"
    return None
