"""Sign-in limits bind only the address whose sign-ins failed (a pure table of the
limiter; the pages: tests/dashboard/test_dashboard.py)."""

from __future__ import annotations

import pytest

from idlegrid.dashboard.security import SignInLimiter

STRANGER, VICTIM = "203.0.113.9", "198.51.100.7"


def _limiter(now: list[float]) -> SignInLimiter:
    return SignInLimiter(per_account=5, per_address=20, window_s=900.0, clock=lambda: now[0])


@pytest.mark.parametrize(
    ("failures", "login", "address", "waits"),
    [
        # (name, address) pairs that failed, then who asks
        ([("carol", STRANGER)] * 5, "carol", STRANGER, True),  # the stranger waits
        ([("carol", STRANGER)] * 5, "carol", VICTIM, False),  # the owner does not
        ([("carol", STRANGER)] * 5, "Carol ", STRANGER, True),  # names fold case and space
        ([("carol", STRANGER)] * 4, "carol", STRANGER, False),
        ([(f"name{i}", STRANGER) for i in range(20)], "carol", STRANGER, True),  # per address
        ([(f"name{i}", STRANGER) for i in range(20)], "carol", VICTIM, False),
        ([("carol", f"10.0.0.{i}") for i in range(100)], "carol", VICTIM, False),  # many
    ],
)
def test_who_waits_after_failed_sign_ins(
    failures: list[tuple[str, str]], login: str, address: str, waits: bool
) -> None:
    now = [0.0]
    limiter = _limiter(now)
    for name, source in failures:
        limiter.failed(name, source)
    assert (limiter.wait_s(login, address) > 0) is waits


def test_a_success_clears_its_address_only_and_failures_slide_out() -> None:
    now = [0.0]
    limiter = _limiter(now)
    for _ in range(4):
        limiter.failed("carol", STRANGER)
        limiter.failed("carol", VICTIM)
    limiter.succeeded("carol", VICTIM)
    limiter.failed("carol", STRANGER)
    limiter.failed("carol", VICTIM)
    assert limiter.wait_s("carol", STRANGER) == pytest.approx(900.0)
    assert limiter.wait_s("carol", VICTIM) == 0
    now[0] = 900.0  # the first failure leaves the window
    assert limiter.wait_s("carol", STRANGER) == 0
