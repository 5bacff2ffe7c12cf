"""Shared fixtures of the in-process tier: a real SqlStore on a temporary SQLite file, and
the coordinator app under starlette's TestClient with its lifespan running."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from idlegrid.coordinator.app import create_app
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.sql import SqlStore

# Small limits so the 413 paths are cheap to reach.
MAX_BLOB_BYTES = 4096
MAX_REQUEST_BYTES = 2048


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> str:
    """Every API error is JSON {"error", "message"}; return the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) >= {"error", "message"}, body
    assert isinstance(body["error"], str) and body["error"]
    assert isinstance(body["message"], str) and body["message"]
    if code is not None:
        assert body["error"] == code, body
    return str(body["message"])


# -- store --------------------------------------------------------------------------------


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[SqlStore]:
    sql_store = SqlStore(db_url)
    await sql_store.open()
    try:
        yield sql_store
    finally:
        await sql_store.close()


# -- coordinator app ------------------------------------------------------------------------


@pytest.fixture
def settings(tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        data_dir=tmp_path / "coordinator",
        max_blob_bytes=MAX_BLOB_BYTES,
        max_request_bytes=MAX_REQUEST_BYTES,
        # The monitor's periodic passes stay out of the way; its startup pass still runs.
        monitor_interval_s=3600.0,
    )


@dataclass
class Api:
    """A TestClient with the admin's token and helpers to make more tokens."""

    client: TestClient
    settings: CoordinatorSettings
    admin_token: str

    @property
    def admin(self) -> dict[str, str]:
        return bearer(self.admin_token)

    def token(self, *, account: str | None = None, kind: str = "api") -> str:
        body: dict[str, Any] = {"kind": kind}
        if account is not None:
            body["account"] = account
        response = self.client.post("/v1/tokens", json=body, headers=self.admin)
        assert response.status_code == 201, response.text
        return str(response.json()["token"])

    def upload(self, data: bytes, token: str | None = None) -> str:
        blob_hash = sha(data)
        response = self.client.put(
            f"/v1/blobs/{blob_hash}", content=data, headers=bearer(token or self.admin_token)
        )
        assert response.status_code == 201, response.text
        return blob_hash

    def submit(self, token: str, **body: Any) -> dict[str, Any]:
        response = self.client.post("/v1/jobs", json=body, headers=bearer(token))
        assert response.status_code == 201, response.text
        return dict(response.json())

    def job(self, token: str, job_id: int) -> dict[str, Any]:
        response = self.client.get(f"/v1/jobs/{job_id}", headers=bearer(token))
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture
def api(settings: CoordinatorSettings) -> Iterator[Api]:
    with TestClient(create_app(settings)) as client:
        admin_token = settings.admin_token_file.read_text().strip()
        yield Api(client=client, settings=settings, admin_token=admin_token)
