"""The coordinator's bootstrap DHT peer, run as `python -m idlegrid.p2p.bootstrap`.

A child process of `idlegrid serve` (the coordinator itself never imports torch, which
Hivemind needs). It prints one line, `{"peers": [multiaddress, ...]}`, once the DHT
listens, then serves until its standard input closes (the coordinator exited or
stopped it) or its parent is gone. With `--identity` its peer id survives restarts, so
the addresses in tasks already handed out stay good.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from idlegrid import p2p


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m idlegrid.p2p.bootstrap")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--announce", default="", help="host that nodes reach it at")
    parser.add_argument("--identity", default="", help="file that keeps its peer id")
    options = parser.parse_args(argv)
    import hivemind

    announce = []
    if options.announce:
        announce = [f"/ip4/{options.announce}/tcp/{options.port}"]
    dht = hivemind.DHT(
        start=True,
        host_maddrs=[f"/ip4/{options.host}/tcp/{options.port}"],
        announce_maddrs=announce or None,
        identity_path=options.identity or None,
        wait_timeout=p2p.DHT_REQUEST_TIMEOUT_S,
    )
    peers = [str(address) for address in dht.get_visible_maddrs()]
    print(json.dumps({"peers": peers}), flush=True)
    parent = os.getppid()
    closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not closed.is_set() and os.getppid() == parent:
        time.sleep(0.5)
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
