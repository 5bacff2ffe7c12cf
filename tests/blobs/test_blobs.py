"""Content-addressed blob storage: hashes checked, limits kept, nothing half-written left."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from idlegrid.blobs.files import (
    BlobError,
    BlobStore,
    StoredInputs,
    input_hash,
    is_blob_hash,
    sha256_hex,
)

LIMIT = 1000


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs", max_bytes=LIMIT)


async def _chunks(parts: Iterable[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _tmp_files(blobs: BlobStore) -> list[str]:
    return os.listdir(blobs.root / "tmp")


def _stored(blobs: BlobStore) -> list[Path]:
    return [p for p in blobs.root.rglob("*") if p.is_file() and p.parent.name != "tmp"]


def test_put_read_exists(blobs: BlobStore) -> None:
    blob_hash = blobs.put(b"hello")
    assert blob_hash == sha256_hex(b"hello")
    assert blobs.exists(blob_hash)
    assert blobs.read(blob_hash) == b"hello"
    assert blobs.size(blob_hash) == 5
    # Laid out as <root>/ab/cdef..., the name being the hash.
    assert blobs.path(blob_hash) == blobs.root / blob_hash[:2] / blob_hash[2:]
    assert _tmp_files(blobs) == []


def test_put_is_idempotent(blobs: BlobStore) -> None:
    assert blobs.put(b"same") == blobs.put(b"same")
    assert len(_stored(blobs)) == 1
    assert _tmp_files(blobs) == []


def test_empty_blob(blobs: BlobStore) -> None:
    blob_hash = blobs.put(b"")
    assert blobs.read(blob_hash) == b""


def test_missing_blob_is_404(blobs: BlobStore) -> None:
    missing = sha256_hex(b"never stored")
    assert not blobs.exists(missing)
    with pytest.raises(BlobError) as raised:
        blobs.read(missing)
    assert raised.value.status == 404


def test_put_over_the_limit_is_413(blobs: BlobStore) -> None:
    blobs.put(b"x" * LIMIT)  # exactly at the limit is fine
    with pytest.raises(BlobError) as raised:
        blobs.put(b"x" * (LIMIT + 1))
    assert raised.value.status == 413
    assert not blobs.exists(sha256_hex(b"x" * (LIMIT + 1)))


@pytest.mark.parametrize(
    "bad", ["", "abc", "AB" * 32, "g" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "a" * 62 + "/x"]
)
def test_bad_hashes_are_422(blobs: BlobStore, bad: str) -> None:
    assert not is_blob_hash(bad)
    for call in (blobs.path, blobs.exists, blobs.read):
        with pytest.raises(BlobError) as raised:
            call(bad)
        assert raised.value.status == 422


async def test_put_stream_stores_a_matching_upload(blobs: BlobStore) -> None:
    data = b"abc" * 100
    size = await blobs.put_stream(sha256_hex(data), _chunks([data[:7], data[7:200], data[200:]]))
    assert size == len(data)
    assert blobs.read(sha256_hex(data)) == data
    assert _tmp_files(blobs) == []


async def test_put_stream_of_a_stored_blob_keeps_one_copy(blobs: BlobStore) -> None:
    blob_hash = blobs.put(b"twice")
    assert await blobs.put_stream(blob_hash, _chunks([b"tw", b"ice"])) == 5
    assert len(_stored(blobs)) == 1
    assert _tmp_files(blobs) == []


async def test_put_stream_hash_mismatch_is_422_and_leaves_nothing(blobs: BlobStore) -> None:
    claimed = sha256_hex(b"what I said")
    with pytest.raises(BlobError) as raised:
        await blobs.put_stream(claimed, _chunks([b"what I ", b"sent"]))
    assert raised.value.status == 422
    assert claimed in raised.value.message
    assert not blobs.exists(claimed)
    assert _tmp_files(blobs) == []
    assert _stored(blobs) == []


async def test_put_stream_over_the_limit_is_413_and_leaves_nothing(blobs: BlobStore) -> None:
    data = b"y" * (LIMIT + 1)
    with pytest.raises(BlobError) as raised:
        await blobs.put_stream(sha256_hex(data), _chunks([data[:600], data[600:]]))
    assert raised.value.status == 413
    assert _tmp_files(blobs) == []
    assert _stored(blobs) == []


async def test_put_stream_bad_hash_is_422_before_reading(blobs: BlobStore) -> None:
    read: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        read.append(b"x")
        yield b"x"

    with pytest.raises(BlobError) as raised:
        await blobs.put_stream("not-a-hash", body())
    assert raised.value.status == 422
    assert read == []
    assert _tmp_files(blobs) == []


async def test_put_stream_interrupted_upload_leaves_nothing(blobs: BlobStore) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"partial"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await blobs.put_stream(sha256_hex(b"partial and more"), broken())
    assert _tmp_files(blobs) == []
    assert _stored(blobs) == []


def test_stored_inputs_are_read_when_asked_for_and_named_without_hashing(
    blobs: BlobStore,
) -> None:
    model, data = b"model bytes", b"data bytes"
    names = {"model": blobs.put(model), "data": blobs.put(data)}
    inputs = StoredInputs(blobs, names)
    blobs.path(names["model"]).unlink()  # never read: asking for its hash must not
    assert input_hash(inputs, "model") == names["model"]
    assert inputs["data"] == data
    assert sorted(inputs) == ["data", "model"] and len(inputs) == 2
    with pytest.raises(BlobError):
        inputs["model"]
    assert input_hash({"data": data}, "data") == sha256_hex(data)  # a plain mapping: hashed


def test_put_many_stores_each_in_order_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("idlegrid.blobs.files.PARALLEL_PUT_BYTES", 100)  # LIMIT-sized blobs
    store = BlobStore(tmp_path / "many", max_bytes=LIMIT)
    payloads = [bytes([i]) * 900 for i in range(8)] + [bytes([3]) * 900]  # one twice
    hashes = store.put_many(payloads)
    assert hashes == [sha256_hex(p) for p in payloads]
    assert [store.read(h) for h in hashes] == payloads
    assert store.put_many([]) == [] and store.put_many([b"x"]) == [sha256_hex(b"x")]
    put = store.put

    def slow_put(blob: bytes) -> str:  # the last write is still going when one fails
        if blob.startswith(b"z"):
            time.sleep(0.3)  # a slow write is what the test needs
        return put(blob)

    monkeypatch.setattr(store, "put", slow_put)
    with pytest.raises(BlobError) as over:  # a pool thread's error reaches the caller
        store.put_many([b"small" * 10, b"y" * (LIMIT + 1), b"z" * 500])
    assert over.value.status == 413
    assert not list((tmp_path / "many" / "tmp").iterdir())  # nothing half-written left
    assert store.exists(sha256_hex(b"z" * 500))  # the others ended before the error came back


def test_blobs_the_coordinator_makes_have_no_size_limit(blobs: BlobStore) -> None:
    checkpoint = b"w" * (LIMIT * 3)  # a round's weights: as large as the accepted model
    with pytest.raises(BlobError):
        blobs.put(checkpoint)  # what a client sends is bounded
    assert blobs.read(blobs.keep(checkpoint)) == checkpoint


def test_a_finished_file_is_stored_only_under_the_hash_named(
    blobs: BlobStore, tmp_path: Path
) -> None:
    data = b"m" * (LIMIT * 2)
    path = blobs.tmp_path("upload-1")
    path.write_bytes(data + b"tail of a chunk written twice")
    with pytest.raises(BlobError) as wrong:
        blobs.put_file(
            path, size=len(data), expected_hash=sha256_hex(b"other"), max_bytes=len(data)
        )
    assert wrong.value.status == 422 and sha256_hex(data) in wrong.value.message
    assert not path.exists() and not blobs.exists(sha256_hex(data))
    path.write_bytes(data)
    with pytest.raises(BlobError) as over:  # the store's own limit, unless told another
        blobs.put_file(path, size=len(data), expected_hash=sha256_hex(data))
    assert over.value.status == 413 and "POST /v1/uploads" in over.value.message
    path.write_bytes(data)
    stored = blobs.put_file(
        path, size=len(data), expected_hash=sha256_hex(data), max_bytes=len(data)
    )
    assert stored == sha256_hex(data) and blobs.read(stored) == data
