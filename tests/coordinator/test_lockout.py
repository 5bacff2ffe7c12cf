"""No honest caller is locked out by others' failures: an address past its limit of
unknown tokens gets 429 for unknown tokens, cheaply (no lookup), and is still let in
with a token that exists, on the REST API and the node WebSocket. (Sign-in limits:
tests/dashboard/test_signin_limits.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import Api, bearer
from helpers import NODE_WS, SocketNode
from starlette.testclient import TestClient

from idlegrid.app import create_app
from idlegrid.coordinator.guard import AuthFailures, Guard, KnownTokens, RateLimited
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import TokenInfo

WRONG_TOKENS = 1_000
# Past its limit an address's unknown token waits for the shared read of new tokens (at
# most one every `KnownTokens.min_interval_s`, 0.25 s): one after another, a thousand
# take four minutes; sent at once, as a flood comes, they share those reads.
AT_ONCE = 50


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass
class FakeTokens:
    """A `TokenSource` over a dict, counting what is asked of it."""

    live: dict[str, int] = dataclasses.field(default_factory=dict)  # hash -> id
    lookups: int = 0
    reads: list[int] = dataclasses.field(default_factory=list)  # after_id of each page

    def make(self, token: str) -> str:
        self.live[_hash(token)] = len(self.live) + 1
        return _hash(token)

    async def find_token(self, token_hash: str) -> TokenInfo | None:
        self.lookups += 1
        if token_hash not in self.live:
            return None
        return TokenInfo(
            token_id=self.live[token_hash],
            account_id=1,
            account_name="alice",
            kind="api",
            is_admin=False,
        )

    async def live_token_hashes(self, *, after_id: int, limit: int) -> list[tuple[int, str]]:
        self.reads.append(after_id)
        found = sorted((i, h) for h, i in self.live.items() if i > after_id)
        return found[:limit]


def _guard(limit: int = 3) -> Guard:
    return Guard(
        auth=AuthFailures(limit=limit, window_s=600),
        pending=None,  # type: ignore[arg-type]  # not used here
        metrics_allow=None,  # type: ignore[arg-type]
        tokens=KnownTokens(min_interval_s=0.0),
    )


def test_past_the_limit_unknown_tokens_cost_no_lookup_and_known_ones_pass() -> None:
    async def scenario() -> None:
        guard, source = _guard(), FakeTokens()
        good = source.make("good")
        for i in range(3):
            assert await guard.authenticate("a", _hash(f"guess-{i}"), source) is None
        assert source.lookups == 3 and source.reads == []  # under the limit: plain lookups
        source.lookups = 0
        for i in range(WRONG_TOKENS):
            with pytest.raises(RateLimited):
                await guard.authenticate("a", _hash(f"more-{i}"), source)
        assert source.lookups == 0  # refused from memory
        assert await guard.authenticate("a", good, source) is not None
        assert source.lookups == 1
        # Another address is not limited at all.
        assert await guard.authenticate("b", _hash("guess"), source) is None

    asyncio.run(scenario())


def test_a_token_made_after_the_last_read_is_found_by_the_next() -> None:
    async def scenario() -> None:
        guard, source = _guard(limit=1), FakeTokens()
        source.make("first")
        assert await guard.authenticate("a", _hash("guess"), source) is None
        with pytest.raises(RateLimited):
            await guard.authenticate("a", _hash("guess"), source)
        assert source.reads == [0]  # the first read reads every live token
        late = source.make("made-elsewhere")  # as by another coordinator process
        assert await guard.authenticate("a", late, source) is not None
        assert source.reads == [0, 0]  # the overlap re-reads the last ids, not all

    asyncio.run(scenario())


def test_a_revoked_token_is_looked_up_once_then_refused_from_memory() -> None:
    async def scenario() -> None:
        guard, source = _guard(limit=1), FakeTokens()
        revoked = source.make("soon-revoked")
        assert await guard.authenticate("a", revoked, source) is not None  # now known
        assert await guard.authenticate("a", _hash("guess"), source) is None
        del source.live[revoked]
        source.lookups = 0
        assert await guard.authenticate("a", revoked, source) is None  # one lookup
        with pytest.raises(RateLimited):
            await guard.authenticate("a", revoked, source)
        assert source.lookups == 1

    asyncio.run(scenario())


def test_concurrent_misses_share_one_read() -> None:
    async def scenario() -> None:
        guard, source = _guard(limit=1), FakeTokens()
        guard.tokens.min_interval_s = 0.05
        assert await guard.authenticate("a", _hash("guess"), source) is None
        misses = [guard.authenticate("a", _hash(f"g{i}"), source) for i in range(200)]
        outcomes = await asyncio.gather(*misses, return_exceptions=True)
        assert all(isinstance(o, RateLimited) for o in outcomes)
        assert len(source.reads) <= 2  # one read, and at most one begun after it

    asyncio.run(scenario())


# -- the app, in process --------------------------------------------------------------------


@pytest.fixture
def api(settings: CoordinatorSettings) -> Iterator[Api]:
    changed = dataclasses.replace(
        settings, auth_failures_per_address=30, auth_failure_window_s=3600
    )
    with TestClient(create_app(changed)) as client:
        token = changed.admin_token_file.read_text().strip()
        yield Api(client=client, settings=changed, admin_token=token)


def test_a_thousand_wrong_tokens_lock_out_no_valid_token(api: Api) -> None:
    researcher = api.token(account="alice")
    node_token = api.token(account="volunteer", kind="node")
    accounts = api.client.app.state.grid.store.accounts  # type: ignore[attr-defined]
    lookups = {"n": 0}
    find_token = accounts.find_token

    async def counted(token_hash: str) -> TokenInfo | None:
        lookups["n"] += 1
        return await find_token(token_hash)

    accounts.find_token = counted
    # One after another through the app (pacing of the shared reads: the tests above).
    api.client.app.state.guard.tokens.min_interval_s = 0.0  # type: ignore[attr-defined]
    codes = [
        api.client.get("/v1/me", headers=bearer(f"igr_wrong{i}")).status_code
        for i in range(WRONG_TOKENS)
    ]
    assert codes.count(401) == 30 and codes.count(429) == WRONG_TOKENS - 30
    assert lookups["n"] == 30  # none once the address was over its limit
    assert api.client.get("/v1/me", headers=bearer(researcher)).status_code == 200
    assert api.client.get("/v1/jobs", headers=api.admin).status_code == 200
    with contextlib.ExitStack() as stack:
        ws = stack.enter_context(api.client.websocket_connect(NODE_WS))
        SocketNode(api, ws, node_token).join()


# -- real processes -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_connects_from_an_address_that_sent_a_thousand_wrong_tokens(
    tmp_path: Path,
) -> None:
    env = {"IDLEGRID_AUTH_FAILURE_WINDOW_S": "3600"}  # however slowly the guesses go
    with LocalGrid(
        tmp_path, heartbeat_s=0.5, node_timeout_s=5.0, replication=1, extra_env=env
    ) as grid:
        researcher = grid.create_token(kind="api", account="alice")["token"]
        limits = httpx.Limits(max_connections=AT_ONCE)
        with httpx.Client(base_url=grid.url, limits=limits, timeout=60) as http:

            def wrong(i: int) -> int:
                return http.get("/v1/me", headers=bearer(f"igr_wrong{i}")).status_code

            codes = [wrong(i) for i in range(30)]  # up to the limit, one at a time
            with ThreadPoolExecutor(AT_ONCE) as pool:
                codes += pool.map(wrong, range(30, WRONG_TOKENS))
            assert codes.count(401) == 30 and codes.count(429) == WRONG_TOKENS - 30
            assert http.get("/v1/me", headers=bearer(researcher)).status_code == 200
        grid.start_worker("honest", kinds="sleep", benchmark=False)
        grid.wait_for_nodes(1, timeout=60)
        with grid.client(researcher) as client:
            job = client.submit("sleep", params={"tasks": 2, "seconds": 0.0})
            assert job.wait(timeout=60)["state"] == "completed"
