"""Content-addressed blob storage in a local directory (`<root>/ab/cdef...`).

A blob's name is the SHA-256 of its bytes, so a blob is immutable, deduplicated and
checkable by anyone who holds it. Writes go to a temporary file and are renamed into
place only after the hash matched, so a crash never leaves a half blob under a real name.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from idlegrid.units import size_text

_HASH = re.compile(r"^[0-9a-f]{64}$")

PARALLEL_PUT_BYTES = 1 << 20  # below this in all, `put_many` writes one blob at a time
PUT_THREADS = 4
_writer_pool: ThreadPoolExecutor | None = None
_writer_lock = threading.Lock()


def _writers() -> ThreadPoolExecutor:
    """The threads `put_many` writes with (made on first use, shared by all stores)."""
    global _writer_pool
    with _writer_lock:
        if _writer_pool is None:
            _writer_pool = ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="blob-put")
        return _writer_pool


class BlobError(ValueError):
    """A blob that cannot be stored; `status` is the HTTP status that fits."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class StoredInputs(Mapping[str, bytes]):
    """A job's inputs by name, each read from the store the first time it is asked for:
    code that needs only an input's hash (`input_hash`) neither reads nor hashes it (a
    133 MB model: 40 ms to read, 130 ms to hash, and its size in memory)."""

    def __init__(self, store: BlobStore, hashes: Mapping[str, str]) -> None:
        self._store = store
        self._hashes = dict(hashes)
        self._read: dict[str, bytes] = {}

    def __getitem__(self, name: str) -> bytes:
        data = self._read.get(name)
        if data is None:
            data = self._read[name] = self._store.read(self._hashes[name])
        return data

    def __contains__(self, name: object) -> bool:
        return name in self._hashes  # Mapping's own would read the blob

    def __iter__(self) -> Iterator[str]:
        return iter(self._hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def hash_of(self, name: str) -> str:
        return self._hashes[name]

    def file_of(self, name: str) -> Path:
        """The stored file of input `name` (for readers that map a large file)."""
        return self._store.file(self._hashes[name])


def input_hash(inputs: Mapping[str, bytes], name: str) -> str:
    """The SHA-256 of input `name`: its name in the store where it came from there (the
    store checked it on arrival), else computed."""
    if isinstance(inputs, StoredInputs):
        return inputs.hash_of(name)
    return sha256_hex(inputs[name])


def is_blob_hash(value: str) -> bool:
    return bool(_HASH.match(value))


class BlobStore:
    """Blobs under one directory; safe for several processes sharing that directory."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)

    def path(self, blob_hash: str) -> Path:
        if not is_blob_hash(blob_hash):
            raise BlobError(422, f"not a SHA-256 hex digest: {blob_hash[:80]!r}")
        return self.root / blob_hash[:2] / blob_hash[2:]

    def exists(self, blob_hash: str) -> bool:
        return self.path(blob_hash).is_file()

    def size(self, blob_hash: str) -> int:
        return self.path(blob_hash).stat().st_size

    def file(self, blob_hash: str) -> Path:
        """The blob's file, to stream from (a 404 BlobError if it is not stored)."""
        path = self.path(blob_hash)
        if not path.is_file():
            raise BlobError(404, f"no blob {blob_hash}")
        return path

    def read(self, blob_hash: str) -> bytes:
        try:
            return self.path(blob_hash).read_bytes()
        except FileNotFoundError:
            raise BlobError(404, f"no blob {blob_hash}") from None

    def put(self, data: bytes) -> str:
        """Store bytes; return their hash."""
        if len(data) > self.max_bytes:
            raise BlobError(413, blob_too_large(len(data), self.max_bytes))
        return self.keep(data)

    def keep(self, data: bytes) -> str:
        """Store bytes the coordinator made itself (a training round's weights, a job's
        result); return their hash. No size limit: the size follows from a job that was
        accepted (a model's checkpoint is as large as the model its owner uploaded, up
        to their quota), and refusing it now would fail that job halfway."""
        blob_hash = sha256_hex(data)
        if not self.exists(blob_hash):
            fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            self._commit(Path(tmp), blob_hash)
        return blob_hash

    def put_many(self, blobs: Sequence[bytes]) -> list[str]:
        """`put` each; their hashes in order. Several large ones are hashed, written and
        synced a few at a time (hashing, writing and fsync let other threads run): a
        job's ten 2 MB shard payloads take 20 ms instead of 45. On an error every write
        has ended (stored or cleaned up) before it is raised."""
        if len(blobs) < 2 or sum(len(b) for b in blobs) < PARALLEL_PUT_BYTES:
            return [self.put(blob) for blob in blobs]
        futures = [_writers().submit(self.put, blob) for blob in blobs]
        wait(futures)
        return [future.result() for future in futures]

    async def put_stream(
        self, expected_hash: str, chunks: AsyncIterator[bytes], *, max_bytes: int | None = None
    ) -> int:
        """Store a streamed upload that must hash to `expected_hash`; return its size.
        `max_bytes`: a lower limit than the store's for this one."""
        limit = self.max_bytes if max_bytes is None else min(max_bytes, self.max_bytes)
        target = self.path(expected_hash)
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise BlobError(413, blob_too_large(None, limit))
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != expected_hash:
                raise BlobError(422, f"content hashes to {digest.hexdigest()}, not {expected_hash}")
            if target.is_file():
                os.unlink(tmp)
            else:
                self._commit(Path(tmp), expected_hash)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)  # noqa: ASYNC240 - one local unlink
            raise
        return size

    def tmp_path(self, name: str) -> Path:
        """A file for a blob still being written (see `put_file`), beside the blobs."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", name) or name.startswith("."):
            raise BlobError(422, f"not a temporary file name: {name[:80]!r}")
        return self.root / "tmp" / name

    def put_file(
        self,
        path: Path,
        *,
        size: int,
        expected_hash: str | None = None,
        max_bytes: int | None = None,
    ) -> str:
        """Store a finished file (moved, not copied) of `size` bytes; return its hash.

        The file is cut to `size` first (a chunk written twice may have left a tail);
        it is gone afterwards whatever happens. With `expected_hash` a file that hashes
        to anything else is refused (422) and never stored. `max_bytes`: the limit of
        this one instead of the store's (a chunked upload: the account's quota).
        """
        limit = self.max_bytes if max_bytes is None else max_bytes
        try:
            if size > limit:
                raise BlobError(413, blob_too_large(size, limit))
            digest = hashlib.sha256()
            with open(path, "r+b") as handle:
                handle.truncate(size)
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
            blob_hash = digest.hexdigest()
            if expected_hash is not None and blob_hash != expected_hash:
                raise BlobError(
                    422,
                    f"the {size_text(size)} received hash to {blob_hash}, not {expected_hash}"
                    " (the file changed while it was sent, or the hash named is not its)",
                )
            if self.exists(blob_hash):
                path.unlink()
            else:
                self._commit(path, blob_hash)
            return blob_hash
        finally:
            path.unlink(missing_ok=True)

    def _commit(self, tmp: Path, blob_hash: str) -> None:
        target = self.path(blob_hash)
        target.parent.mkdir(exist_ok=True)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)


def blob_too_large(size: int | None, limit: int) -> str:
    """Why a blob is refused for its size, and what to do."""
    what = f"blob of {size_text(size)}" if size is not None else "blob"
    raise_to = f" to at least {size} (IDLEGRID_MAX_BLOB_BYTES={size})" if size else ""
    return (
        f"{what} is over the {size_text(limit)} limit of one blob sent in one request "
        f"(max_blob_bytes {limit}): send it in chunks (POST /v1/uploads; the SDK and CLI "
        f"do so by themselves), or ask the operator to raise max_blob_bytes{raise_to}"
    )
