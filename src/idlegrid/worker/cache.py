"""Input blobs cached on the node by hash, fetched over HTTP and checked on arrival."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import httpx


class BlobMismatch(ValueError):
    pass


class BlobCache:
    """A directory of blobs named by SHA-256; least recently used ones go past `max_bytes`."""

    def __init__(self, root: Path, *, max_bytes: int = 2 * 1024**3) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def path(self, blob_hash: str) -> Path:
        return self.root / blob_hash

    def holds(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if len(p.name) == 64]

    async def get(self, http: httpx.AsyncClient, blob_hash: str) -> bytes:
        """The blob's bytes, from the cache or the coordinator (SHA-256 checked)."""
        path = self.path(blob_hash)
        if path.is_file():
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == blob_hash:
                self.hits += 1
                os.utime(path)
                return data
            path.unlink()  # corrupted on disk: fetch again
        self.misses += 1
        response = await http.get(f"/v1/blobs/{blob_hash}")
        response.raise_for_status()
        data = response.content
        if hashlib.sha256(data).hexdigest() != blob_hash:
            raise BlobMismatch(f"blob {blob_hash} arrived with other content")
        self._store(blob_hash, data)
        return data

    def _store(self, blob_hash: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, self.path(blob_hash))
        self._evict()

    def _evict(self) -> None:
        files = sorted(
            (p for p in self.root.iterdir() if len(p.name) == 64),
            key=lambda p: p.stat().st_mtime,
        )
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
