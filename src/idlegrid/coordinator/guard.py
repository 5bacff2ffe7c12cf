"""Limits per client address, kept in one coordinator process's memory.

- `AuthFailures`: failed authentications (unknown tokens) per address in a sliding
  window. Past the limit, an unknown token from that address is answered 429 without a
  database lookup, so guessing tokens costs the guesser time, not the coordinator
  database reads; a token that exists is still looked up and let in (`KnownTokens`), so
  one bad client behind a shared address (a proxy, a NAT) locks nobody else out.
- `KnownTokens`: the live tokens' hashes as this process last read them, which tell a
  token that may exist from one that does not without a lookup.
- `PendingSockets`: node sockets open but not yet past their hello, in all and per
  address: a socket that never authenticates holds a slot only until its hello deadline.
- `AddressList`: the addresses (or networks) that may read /metrics without a token.

Several coordinator processes each keep their own counts: a client spread over N of
them gets N times the allowance, which these limits tolerate (they bound cost, they
are not a security boundary of their own).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import TokenInfo

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


class RateLimited(Exception):
    """An unknown token from an address past `auth_failures_per_address`."""

    def __init__(self, failures: AuthFailures, wait_s: float) -> None:
        super().__init__(
            f"too many unknown tokens from this address (auth_failures_per_address "
            f"{failures.limit} in {failures.window_s:g} s); try again in {wait_s:.0f} s"
        )
        self.wait_s = wait_s

    @property
    def retry_after(self) -> str:
        return str(math.ceil(self.wait_s))


class TokenSource(Protocol):
    """Where tokens are looked up (`store.accounts`)."""

    async def find_token(self, token_hash: str) -> TokenInfo | None: ...

    async def live_token_hashes(self, *, after_id: int, limit: int) -> list[tuple[int, str]]: ...


# Live tokens read per query when a process learns which exist.
_TOKEN_PAGE = 10_000
# Ids re-read below the highest one read: on PostgreSQL a token whose id was drawn
# before another's may commit after it (two processes making tokens at once).
_ID_OVERLAP = 100


def _key(token_hash: str) -> int:
    """A token hash's first 64 bits: 8 bytes of memory a token, not a 64-byte string."""
    return int(token_hash[:16], 16)


@dataclass
class KnownTokens:
    """The hashes of the live tokens, as this process last read them.

    Consulted only for an address past its failure limit. A token found here is looked
    up in the database as any other (a revoked one is then forgotten); one not found is
    looked for again after a read of the tokens made since the last read, and refused
    without a lookup if it is not there either. Reads are shared: one at a time, at
    most one every `min_interval_s` in this process however many callers wait for one,
    and each reads only tokens newer than the last (the first reads them all).
    """

    min_interval_s: float = 0.25
    clock: Callable[[], float] = time.monotonic
    _known: set[int] = field(default_factory=set)
    _max_id: int = 0
    _reads: int = 0
    _last_read: float = -math.inf
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def add(self, token_hash: str) -> None:
        self._known.add(_key(token_hash))

    def forget(self, token_hash: str) -> None:
        self._known.discard(_key(token_hash))

    async def may_exist(self, token_hash: str, source: TokenSource) -> bool:
        """Whether a live token may have this hash, as of a read begun after this call."""
        key = _key(token_hash)
        if key in self._known:
            return True
        reads_before = self._reads
        async with self._lock:
            if self._reads == reads_before:  # no read began while this call waited
                await self._read(source)
        return key in self._known

    async def _read(self, source: TokenSource) -> None:
        wait_s = self._last_read + self.min_interval_s - self.clock()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._reads += 1
        self._last_read = self.clock()
        after_id = max(0, self._max_id - _ID_OVERLAP) if self._reads > 1 else 0
        while True:
            page = await source.live_token_hashes(after_id=after_id, limit=_TOKEN_PAGE)
            self._known.update(_key(token_hash) for _, token_hash in page)
            if page:
                after_id = page[-1][0]
                self._max_id = max(self._max_id, after_id)
            if len(page) < _TOKEN_PAGE:
                return


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
    tokens: KnownTokens = field(default_factory=KnownTokens)

    async def authenticate(
        self, address: str, token_hash: str, source: TokenSource
    ) -> TokenInfo | None:
        """The live token with this hash (None: none), looked up for a caller at `address`.

        Raises `RateLimited`, before any lookup, for a token that does not exist sent from
        an address past its failure limit; a token that exists is never refused for that.
        """
        wait_s = self.auth.retry_after_s(address)
        if wait_s > 0 and not await self.tokens.may_exist(token_hash, source):
            raise RateLimited(self.auth, wait_s)
        token = await source.find_token(token_hash)
        if token is None:
            self.auth.failed(address)
            self.tokens.forget(token_hash)
        else:
            self.tokens.add(token_hash)
        return token

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
