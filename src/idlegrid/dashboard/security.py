"""Passwords, session cookies, CSRF tokens and sign-in rate limits of the dashboard.

- Passwords: Argon2id (argon2-cffi's defaults, RFC 9106's second recommendation), hashed
  in a worker thread so a sign-in never holds the event loop the node sockets share.
- Sessions: the cookie holds 256 random bits; the store keeps only their SHA-256, so a
  copy of the database signs nobody in. HttpOnly, SameSite=Lax, Secure under https.
- CSRF: a signed-in form carries its session's token; a signed-out one (sign-in,
  sign-up) carries the value of a random cookie (double submit). Both are compared in
  constant time.
- Rate limits: failed sign-ins per account name from one address (whether or not the
  name exists) and per address, in a sliding window, in this process's memory. Each
  binds only the address whose sign-ins failed: a stranger's failures never make a
  victim wait at the victim's own address.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

SESSION_COOKIE = "ig_session"
CSRF_COOKIE = "ig_csrf"
MIN_PASSWORD = 10
_hasher = PasswordHasher()
# Verified against when the account does not exist, so both cases take as long.
_DUMMY_HASH = _hasher.hash(secrets.token_urlsafe(16))


async def hash_password(password: str) -> str:
    return await asyncio.to_thread(_hasher.hash, password)


async def check_password(stored_hash: str | None, password: str) -> bool:
    """Whether `password` matches; as slow for a missing account (None) as for a real one."""
    return await asyncio.to_thread(_verify, stored_hash, password)


def _verify(stored_hash: str | None, password: str) -> bool:
    try:
        _hasher.verify(stored_hash or _DUMMY_HASH, password)
    except (VerificationError, InvalidHashError):
        return False
    return stored_hash is not None


def password_problem(password: str, *, username: str, email: str) -> str | None:
    """Why a new password is too weak, in words; None if it will do."""
    if len(password) < MIN_PASSWORD:
        return f"Choose a password of at least {MIN_PASSWORD} characters."
    if len(password) > 1024:
        return "Choose a password of at most 1,024 characters."
    lowered = password.lower()
    local = email.split("@")[0].lower() if email else ""
    if username.lower() in lowered or (len(local) >= 4 and local in lowered):
        return "Choose a password that does not contain your username or email."
    if len(set(password)) < 5:
        return "Choose a password with more different characters."
    return None


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def session_id(secret: str) -> str:
    """What the store keeps of a session cookie's secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def same(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a), str(b))


@dataclass
class SignInLimiter:
    """At most `per_account` failed sign-ins per account name from one address, and
    `per_address` from one address in all, within `window_s`; a success clears the
    name's count at that address.

    No count spans addresses: an account-wide count would let anyone lock its owner out
    with a few wrong passwords. Guessing one password from many addresses is bounded by
    `per_account` tries per address, by Argon2's cost and by the password rules."""

    per_account: int
    per_address: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def wait_s(self, login: str, address: str) -> float:
        """Seconds until this name from this address may try again; 0: now."""
        now = self.clock()
        waits = [
            self._wait(_name_key(login, address), self.per_account, now),
            self._wait(f"address:{address}", self.per_address, now),
        ]
        return max(waits)

    def failed(self, login: str, address: str) -> None:
        now = self.clock()
        for key in (_name_key(login, address), f"address:{address}"):
            self._failures.setdefault(key, deque()).append(now)
        if len(self._failures) > 100_000:  # a flood of names: forget the stalest
            self._sweep(now)

    def succeeded(self, login: str, address: str) -> None:
        self._failures.pop(_name_key(login, address), None)

    def _wait(self, key: str, limit: int, now: float) -> float:
        times = self._failures.get(key)
        if not times:
            return 0.0
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[key]
            return 0.0
        return times[0] + self.window_s - now if len(times) >= limit else 0.0

    def _sweep(self, now: float) -> None:
        for key in [k for k, t in self._failures.items() if not t or t[-1] <= now - self.window_s]:
            del self._failures[key]


def _name_key(login: str, address: str) -> str:
    return f"account:{login.strip().lower()}@{address}"
