"""Quota checks against the store: the counts an account holds, judged by policy.quotas.

Each raises `QuotaExceeded` (the API answers its status, 413 or 429, with the setting's
name); admin accounts pass every check.
"""

from __future__ import annotations

from idlegrid.policy import quotas as policy
from idlegrid.policy.quotas import QuotaExceeded
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.base import TokenInfo

__all__ = ["QuotaExceeded", "blob_allowance", "check_new_job", "check_new_token", "check_shards"]


async def _is_admin(store: Store, account_id: int) -> bool:
    account = await store.accounts.account_by_id(account_id)
    return account is not None and account.is_admin


def _raise(refusal: QuotaExceeded | None) -> None:
    if refusal is not None:
        raise refusal


async def check_new_token(store: Store, settings: CoordinatorSettings, account_id: int) -> None:
    """One more token of the account (`quota_tokens`)."""
    if await _is_admin(store, account_id):
        return
    live = len(await store.accounts.list_tokens(account_id))
    _raise(policy.tokens_refusal(settings.quotas, live_tokens=live))


async def check_new_job(store: Store, settings: CoordinatorSettings, account_id: int) -> bool:
    """One more job of the account (`quota_open_jobs`); returns whether the account has
    quotas at all (False for admins), for `check_shards`."""
    if await _is_admin(store, account_id):
        return False
    open_jobs = await store.jobs.count_open_jobs(account_id)
    _raise(policy.open_jobs_refusal(settings.quotas, open_jobs=open_jobs))
    return True


def check_shards(settings: CoordinatorSettings, shards: int) -> None:
    """A job of (at least) `shards` shards (`quota_shards_per_job`)."""
    _raise(policy.shards_refusal(settings.quotas, shards=shards))


async def blob_allowance(
    store: Store, settings: CoordinatorSettings, token: TokenInfo, blob_hash: str, size: int | None
) -> int | None:
    """Bytes one more blob of `size` (None: not declared) may have under the account's
    quotas (`quota_blobs`, `quota_blob_bytes`); None: no quota applies. Only researcher
    uploads are counted in: a node writes only the outputs of tasks it holds, and a blob
    the account has already is no new one."""
    if token.kind != "api" or token.is_admin:
        return None
    if await store.blob_owners.owns_or_produced(token.account_id, blob_hash):
        return None
    usage = await store.usage.blob_usage(token.account_id)
    quotas = settings.quotas
    _raise(
        policy.blob_refusal(quotas, blobs_held=usage.blobs, bytes_held=usage.bytes, new_bytes=size)
    )
    return quotas.blob_bytes - usage.bytes
