"""One member of a p2p group, the way a worker's task runs it: `averaging.join` (which
chooses the member's mode from this machine's addresses and starts the averaging child),
then `Joining.average`. A test's stand-in for a worker, run inside a network namespace:

    ip netns exec NS python tests/p2p/nat_member.py GROUP_JSON SHARD SETTING IN OUT

IN: the member's vector (.npy). OUT: what it came to, as JSON (the mean as a list of
floats, or null with the reason).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from idlegrid.p2p import averaging
from idlegrid.p2p.group import Group


def main(argv: list[str]) -> int:
    group = Group.from_json(json.loads(argv[0]))
    shard, setting, given, taken = int(argv[1]), argv[2], Path(argv[3]), Path(argv[4])
    joining = averaging.join(group, shard=shard, reachability_setting=setting)
    done = joining.average(np.load(given), shard=shard, holds_state=shard == 0)
    joining.close()
    averaging.REGISTRY.close()
    values = None if done.values is None else [float(v) for v in done.values]
    taken.write_text(json.dumps({
        "chosen": joining.mode, "ran": done.reachability, "values": values,
        "members": sorted(done.members), "attempt": done.attempt, "reason": done.reason,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
