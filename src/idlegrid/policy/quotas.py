"""Per-account quotas: what an account may hold, and the refusal when it would hold more.

Pure: each check gets what the account holds now and what it asks for, and answers
None or a `QuotaExceeded` naming the setting. Admin accounts have no quotas (the
callers skip the checks). Checks run before the work, so requests racing each other
may overshoot a quota by as many as raced.
"""

from __future__ import annotations

from dataclasses import dataclass

from idlegrid.units import size_text


class QuotaExceeded(Exception):
    """A request over a quota: `status` 413 (this request is too big) or 429 (the
    account holds too much already); `setting` names the limit."""

    def __init__(self, status: int, setting: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.setting = setting
        self.message = message


@dataclass(frozen=True, kw_only=True)
class Quotas:
    blob_bytes: int
    blobs: int
    shards_per_job: int
    open_jobs: int
    tokens: int


def blob_refusal(
    quotas: Quotas, *, blobs_held: int, bytes_held: int, new_bytes: int | None
) -> QuotaExceeded | None:
    """Refusal of one more blob (of `new_bytes`, when known) for an account holding these."""
    if blobs_held >= quotas.blobs:
        return QuotaExceeded(
            429, "quota_blobs", f"the account holds {blobs_held} blobs (quota_blobs {quotas.blobs})"
        )
    needed = bytes_held + (new_bytes or 0)
    if needed > quotas.blob_bytes:
        asked = f" and this one is {size_text(new_bytes)}" if new_bytes else ""
        return QuotaExceeded(
            413,
            "quota_blob_bytes",
            f"the account's blobs take {size_text(bytes_held)}{asked} "
            f"(quota_blob_bytes {quotas.blob_bytes}, {size_text(quotas.blob_bytes)}): "
            f"ask the operator to raise quota_blob_bytes to at least {needed} "
            f"(IDLEGRID_QUOTA_BLOB_BYTES={needed})",
        )
    return None


def open_jobs_refusal(quotas: Quotas, *, open_jobs: int) -> QuotaExceeded | None:
    """Refusal of one more job for an account with `open_jobs` queued or running."""
    if open_jobs >= quotas.open_jobs:
        return QuotaExceeded(
            429,
            "quota_open_jobs",
            f"the account has {open_jobs} jobs queued or running (quota_open_jobs "
            f"{quotas.open_jobs}); wait for some to finish or cancel them",
        )
    return None


def shards_refusal(quotas: Quotas, *, shards: int) -> QuotaExceeded | None:
    """Refusal of a job of `shards` shards (or of at least that many)."""
    if shards > quotas.shards_per_job:
        return QuotaExceeded(
            413,
            "quota_shards_per_job",
            f"the job has more than {quotas.shards_per_job} shards (quota_shards_per_job "
            f"{quotas.shards_per_job}); split it into several jobs or use larger shards",
        )
    return None


def tokens_refusal(quotas: Quotas, *, live_tokens: int) -> QuotaExceeded | None:
    """Refusal of one more token for an account with `live_tokens` not revoked."""
    if live_tokens >= quotas.tokens:
        return QuotaExceeded(
            429,
            "quota_tokens",
            f"the account has {live_tokens} live tokens (quota_tokens {quotas.tokens}); "
            "revoke some first",
        )
    return None
