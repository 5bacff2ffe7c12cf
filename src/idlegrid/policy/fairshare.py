"""Fair share between researchers: recent usage against configured shares. Pure.

Like BOINC's resource share and Slurm's classic fair-share factor: every account has a
share (default 1). Its recent usage is the FLOPs of the tasks handed out for its jobs,
decayed exponentially with a half-life, so old work is forgiven. An account's factor is

    factor = 2 ** -(usage fraction / share fraction)

over the accounts with recent usage plus the one asking: 1.0 for an account that used
nothing lately, 0.5 for one that used exactly its share, towards 0 for one far over it.
The scheduler adds `w_fair_share x factor` to every task of the account's jobs, so a
small job of a light user overtakes a big job of a heavy one without stopping it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DEFAULT_SHARE = 1.0


def decay(value: float, elapsed_s: float, half_life_s: float) -> float:
    """`value` after `elapsed_s` of exponential decay with this half-life."""
    if half_life_s <= 0:
        return 0.0
    return value * math.pow(0.5, max(0.0, elapsed_s) / half_life_s)


def factor(
    usage: Mapping[int, float],
    shares: Mapping[int, float],
    account_id: int,
    *,
    default_share: float = DEFAULT_SHARE,
) -> float:
    """The account's fair-share factor in (0, 1] (module docstring)."""
    total_usage = sum(usage.values())
    if total_usage <= 0:
        return 1.0
    active = {a for a, used in usage.items() if used > 0} | {account_id}
    total_share = sum(shares.get(a, default_share) for a in active)
    share = shares.get(account_id, default_share) / total_share
    used = usage.get(account_id, 0.0) / total_usage
    return math.pow(2.0, -used / share)


class UsageLedger:
    """Decayed usage per account, in memory.

    Each coordinator process keeps its own ledger of what it handed out (and starts empty):
    with several processes every one still steers towards the shares, each by its part.
    """

    def __init__(self, *, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._usage: dict[int, tuple[float, float]] = {}  # account -> (value, as of)

    def add(self, account_id: int, flops: float, *, now: float) -> None:
        """Charge `flops` of handed-out work to the account."""
        self._usage[account_id] = (self.usage(account_id, now=now) + flops, now)

    def usage(self, account_id: int, *, now: float) -> float:
        value, at = self._usage.get(account_id, (0.0, now))
        return decay(value, now - at, self.half_life_s)

    def snapshot(self, *, now: float) -> dict[int, float]:
        """Every account's decayed usage now."""
        return {account: self.usage(account, now=now) for account in self._usage}
