"""Input blobs cached on the node by hash, fetched over HTTP and checked on arrival."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import httpx


class BlobMismatch(ValueError):
    pass


class BlobCache:
    """A directory of blobs named by SHA-256; least recently used ones go past `max_bytes`.

    One daemon owns the directory. What it holds (sizes, in order of last use) is read
    from the files once, at start, and kept in memory after that, so storing a blob
    costs the same with ten files as with a hundred thousand.
    """

    def __init__(self, root: Path, *, max_bytes: int = 2 * 1024**3) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0
        # Told the size of each blob fetched from the coordinator (the daily cap).
        self.on_download: Callable[[int], None] | None = None
        held = []
        for path in self.root.iterdir():
            if len(path.name) == 64:
                stat = path.stat()
                held.append((stat.st_mtime, path.name, stat.st_size))
        self._sizes: OrderedDict[str, int] = OrderedDict(
            (name, size) for _, name, size in sorted(held)
        )
        self._total = sum(self._sizes.values())

    def path(self, blob_hash: str) -> Path:
        return self.root / blob_hash

    def holds(self) -> list[str]:
        """The blobs held, least recently used first."""
        return list(self._sizes)

    async def get(self, http: httpx.AsyncClient, blob_hash: str) -> bytes:
        """The blob's bytes, from the cache or the coordinator (SHA-256 checked)."""
        path = self.path(blob_hash)
        if path.is_file():
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == blob_hash:
                self.hits += 1
                os.utime(path)  # the order of use survives a restart
                self._note(blob_hash, len(data))
                return data
            self._forget(blob_hash)  # corrupted on disk: fetch again
        self.misses += 1
        response = await http.get(f"/v1/blobs/{blob_hash}")
        response.raise_for_status()
        data = response.content
        if hashlib.sha256(data).hexdigest() != blob_hash:
            raise BlobMismatch(f"blob {blob_hash} arrived with other content")
        self._store(blob_hash, data)
        if self.on_download is not None:
            self.on_download(len(data))
        return data

    def _store(self, blob_hash: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, self.path(blob_hash))
        self._note(blob_hash, len(data))
        self._evict()

    def _note(self, blob_hash: str, size: int) -> None:
        """`blob_hash` (of `size` bytes) is the most recently used."""
        self._total += size - self._sizes.pop(blob_hash, 0)
        self._sizes[blob_hash] = size

    def _evict(self) -> None:
        while self._total > self.max_bytes and len(self._sizes) > 1:
            self._forget(next(iter(self._sizes)))

    def _forget(self, blob_hash: str) -> None:
        self._total -= self._sizes.pop(blob_hash, 0)
        self.path(blob_hash).unlink(missing_ok=True)
