"""/v1/tokens, /v1/me and /v1/nodes: an account's tokens, standing and nodes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.api.common import (
    ApiError,
    Caller,
    GridDep,
    ObjectId,
    Researcher,
    router,
)
from idlegrid.coordinator.api.views import NodeOut, credit_out, node_out
from idlegrid.coordinator.auth import display_prefix, hash_token, new_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.quota_checks import QuotaExceeded
from idlegrid.store.base import (
    AccountExists,
    TokenInfo,
)
from idlegrid.verification import trust as trust_policy


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["api", "node"] = "api"
    label: str = Field(default="", max_length=100)
    account: str | None = Field(
        default=None,
        max_length=100,
        pattern=r"^[A-Za-z0-9_.@-]+$",
        description="admin only: make the token for this account (created if missing)",
    )


class TokenOut(BaseModel):
    token: str
    kind: str
    account: str
    prefix: str
    id: int


class TokenListed(BaseModel):
    id: int
    account: str
    kind: str
    prefix: str
    label: str
    created_at: float
    revoked_at: float | None


@router.post("/tokens", status_code=201, response_model=TokenOut, tags=["accounts"])
async def create_token(body: TokenCreate, token: Researcher, grid: GridDep) -> TokenOut:
    """Make a token for your account; admins may name another account (made if new)."""
    account_id, account_name = token.account_id, token.account_name
    if body.account and body.account != token.account_name:
        if not token.is_admin:
            raise ApiError(403, "forbidden", "only admins can make tokens for other accounts")
        account = await grid.store.accounts.get_account(body.account)
        if account is None:
            try:
                account = await grid.store.accounts.create_account(
                    body.account,
                    is_admin=False,
                    now=grid.clock(),
                    role="volunteer" if body.kind == "node" else "researcher",
                )
            except AccountExists:  # made a moment ago by a concurrent request
                account = await grid.store.accounts.get_account(body.account)
                assert account is not None
        account_id, account_name = account.id, account.name
    try:
        await quotas.check_new_token(grid.store, grid.settings, account_id)
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    secret = new_token(body.kind)
    token_id = await grid.store.accounts.add_token(
        account_id,
        kind=body.kind,
        token_hash=hash_token(secret),
        prefix=display_prefix(secret),
        label=body.label,
        now=grid.clock(),
    )
    return TokenOut(
        token=secret,
        kind=body.kind,
        account=account_name,
        prefix=display_prefix(secret),
        id=token_id,
    )


@router.get("/tokens", response_model=list[TokenListed], tags=["accounts"])
async def list_tokens(
    token: Researcher,
    grid: GridDep,
    account: Annotated[str | None, Query(max_length=100)] = None,
    all_accounts: Annotated[bool, Query(alias="all")] = False,
    revoked: bool = False,
) -> list[TokenListed]:
    """Your tokens (never their secrets); admins may ask for one account or all of them."""
    account_id = await _token_scope(grid, token, account, all_accounts)
    found = await grid.store.accounts.list_tokens(account_id, include_revoked=revoked)
    return [TokenListed(**vars(record)) for record in found]


@router.delete("/tokens/{token_id}", response_model=TokenListed, tags=["accounts"])
async def revoke_token(token_id: ObjectId, token: Researcher, grid: GridDep) -> TokenListed:
    """Revoke a token of yours (admins: anyone's). A node already connected with it keeps
    its connection until it drops; it cannot connect again."""
    account_id = None if token.is_admin else token.account_id
    revoked = await grid.store.accounts.revoke_token(
        token_id, account_id=account_id, now=grid.clock()
    )
    if revoked is None:
        raise ApiError(404, "not_found", f"no live token {token_id}")
    return TokenListed(**vars(revoked))


async def _token_scope(
    grid: Grid, token: TokenInfo, account: str | None, all_accounts: bool
) -> int | None:
    """Whose tokens a listing shows: the caller's, or (admins only) another's or all."""
    if not (all_accounts or account) or account == token.account_name:
        return token.account_id
    if not token.is_admin:
        raise ApiError(403, "forbidden", "only admins can list other accounts' tokens")
    if all_accounts:
        return None
    found = await grid.store.accounts.get_account(account or "")
    if found is None:
        raise ApiError(404, "not_found", f"no account {account!r}")
    return found.id


@router.get("/me", tags=["accounts"])
async def me(token: Caller, grid: GridDep) -> dict[str, Any]:
    """Who this token belongs to, with the account's credit and standing."""
    account = await grid.store.accounts.account_by_id(token.account_id)
    assert account is not None  # a valid token's account exists
    return {
        "account": token.account_name,
        "kind": token.kind,
        "admin": token.is_admin,
        **credit_out(account.credit, grid.clock()),
        "flagged": account.flagged_at is not None,
        "flag_reason": account.flag_reason,
    }


@router.get("/nodes", response_model=list[NodeOut], tags=["nodes"])
async def list_nodes(token: Researcher, grid: GridDep) -> list[NodeOut]:
    """Your nodes (all nodes for admins) with hardware, benchmark and uptime."""
    nodes = await grid.store.nodes.list_nodes(None if token.is_admin else token.account_id)
    # Connected to this process or, with several coordinators, to another one.
    connected = await grid.connected()
    now = grid.clock()
    # What each connected node said last, to whichever process holds its socket.
    said = await grid.store.node_control.activity_of([n.id for n in nodes if n.id in connected])
    return [
        node_out(
            node,
            online=node.id in connected,
            now=now,
            activity=said[node.id].reason if node.id in said else "",
        )
        for node in nodes
    ]


@router.get("/nodes/{node_id}/trust", tags=["nodes"])
async def node_trust(node_id: ObjectId, token: Researcher, grid: GridDep) -> list[dict[str, Any]]:
    """A node's trust per kind and backend: streak, totals, quota, credibility."""
    mine = await grid.store.nodes.list_nodes(None if token.is_admin else token.account_id)
    if node_id not in {node.id for node in mine}:
        raise ApiError(404, "not_found", f"no node {node_id}")
    return [
        {
            "kind": row.kind,
            "backend": row.backend,
            "consecutive_valid": row.trust.consecutive_valid,
            "valid": row.trust.valid_total,
            "invalid": row.trust.invalid_total,
            "errors": row.trust.error_total,
            "error_rate": round(row.trust.error_rate, 4),
            "daily_quota": row.trust.daily_quota,
            "used_today": row.quota_used_today,
            "suspended": row.trust.suspended,
            "credibility": round(trust_policy.credibility(row.trust, grid.trust), 6),
            "runs_alone": trust_policy.is_trusted(row.trust, grid.trust),
        }
        for row in await grid.store.nodes.node_trust(node_id)
    ]


@router.get("/nodes/{node_id}/credit", tags=["nodes"])
async def node_credit(node_id: ObjectId, token: Caller, grid: GridDep) -> dict[str, Any]:
    """A node's credit for validated work, as the dashboard shows it; for its worker's
    local page (the node token of its account), its owner, or an admin."""
    nodes = await grid.store.nodes.list_nodes(None if token.is_admin else token.account_id)
    node = next((n for n in nodes if n.id == node_id), None)
    if node is None:
        raise ApiError(404, "not_found", f"no node {node_id}")
    return {"node_id": node_id, **credit_out(node.credit, grid.clock())}
