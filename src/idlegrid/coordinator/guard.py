"""Limits per client address, kept in one coordinator process's memory.

- `AuthFailures`: failed authentications (unknown tokens) per address in a sliding
  window. An address past the limit is answered 429 before its token is looked at, so
  guessing tokens costs the guesser time, not the coordinator database reads.
- `PendingSockets`: node sockets open but not yet past their hello, in all and per
  address: a socket that never authenticates holds a slot only until its hello deadline.
- `AddressList`: the addresses (or networks) that may read /metrics without a token.

Several coordinator processes each keep their own counts: a client spread over N of
them gets N times the allowance, which these limits tolerate (they bound cost, they
are not a security boundary of their own).
"""

from __future__ import annotations

import ipaddress
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from idlegrid.settings import CoordinatorSettings

# Past this many addresses with failures on record, stale ones are forgotten at once.
_SWEEP_AT = 100_000


@dataclass
class AuthFailures:
    """At most `limit` failed authentications per address within `window_s`; 0: no limit."""

    limit: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def retry_after_s(self, address: str) -> float:
        """Seconds until `address` may try to authenticate again; 0: now."""
        if self.limit <= 0:
            return 0.0
        times = self._failures.get(address)
        if not times:
            return 0.0
        now = self.clock()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[address]
            return 0.0
        return times[0] + self.window_s - now if len(times) >= self.limit else 0.0

    def failed(self, address: str) -> None:
        if self.limit <= 0:
            return
        now = self.clock()
        times = self._failures.setdefault(address, deque(maxlen=self.limit))
        times.append(now)
        if len(self._failures) > _SWEEP_AT:
            stale = [a for a, t in self._failures.items() if not t or t[-1] <= now - self.window_s]
            for key in stale:
                del self._failures[key]


def pending_refusal(
    *, total: int, from_address: int, total_limit: int, per_address_limit: int
) -> str | None:
    """Why one more unauthenticated socket is refused, given those open; None: admit."""
    if per_address_limit > 0 and from_address >= per_address_limit:
        return (
            f"{from_address} sockets from this address have not sent their hello yet "
            f"(max_pending_sockets_per_address {per_address_limit})"
        )
    if total_limit > 0 and total >= total_limit:
        return f"{total} sockets have not sent their hello yet (max_pending_sockets {total_limit})"
    return None


@dataclass
class PendingSockets:
    """Node sockets not yet past hello: `admit` counts one in (or says why not),
    `release` counts it out once it authenticated or closed."""

    total_limit: int
    per_address_limit: int
    _by_address: Counter[str] = field(default_factory=Counter)
    _total: int = 0

    def admit(self, address: str) -> str | None:
        refusal = pending_refusal(
            total=self._total,
            from_address=self._by_address[address],
            total_limit=self.total_limit,
            per_address_limit=self.per_address_limit,
        )
        if refusal is None:
            self._by_address[address] += 1
            self._total += 1
        return refusal

    def release(self, address: str) -> None:
        self._total -= 1
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]

    @property
    def total(self) -> int:
        return self._total


class AddressList:
    """Addresses and networks ("127.0.0.1", "10.0.0.0/8", "::1")."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.networks = [ipaddress.ip_network(entry.strip(), strict=False) for entry in entries]

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, str):
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:  # a test client's or a unix socket's name
            return False
        return any(ip in network for network in self.networks)


@dataclass
class Guard:
    """The per-client limits of one coordinator process."""

    auth: AuthFailures
    pending: PendingSockets
    metrics_allow: AddressList

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings) -> Guard:
        return cls(
            auth=AuthFailures(
                limit=settings.auth_failures_per_address, window_s=settings.auth_failure_window_s
            ),
            pending=PendingSockets(
                total_limit=settings.max_pending_sockets,
                per_address_limit=settings.max_pending_sockets_per_address,
            ),
            metrics_allow=AddressList(settings.metrics_allow),
        )
