"""Blob transfers of the worker daemon: through the cache, over the current session.

A transfer that meets a disconnect waits for the next session (and runs as soon as it
is up, not at its next backoff step); failures on a live session back off.
"""

from __future__ import annotations

import asyncio
import logging
import random

import httpx

from idlegrid.worker.cache import BlobCache

log = logging.getLogger(__name__)

UPLOADED_MEMORY = 10_000  # output digests remembered per connection


def backoff_delay(attempt: int, *, base: float, cap: float) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 30)))


class Transfers:
    """Mixed into Worker; the attributes below are the Worker's."""

    cache: BlobCache
    _http: httpx.AsyncClient | None
    _online: asyncio.Event
    _stop: asyncio.Event
    _uploaded: set[str]
    _fetching: dict[str, asyncio.Future[bytes]]

    async def _fetch(self, blob_hash: str) -> bytes:
        """A blob through the cache (a task's input, or one a kind asks for while it runs).

        One download per blob however many tasks want it at once (held tasks of one job
        often share an input, and every shard of a model names the same model blob): a
        fetch that finds the same blob on its way joins that download."""
        pending = self._fetching.get(blob_hash)
        if pending is not None:
            self.cache.hits += 1
            return await asyncio.shield(pending)
        download = asyncio.ensure_future(
            self._with_connection(lambda http: self.cache.get(http, blob_hash))
        )
        # Its failure is each caller's to handle; none left waiting is no unread error.
        download.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._fetching[blob_hash] = download
        try:
            data: bytes = await asyncio.shield(download)
        finally:
            if download.done():
                self._fetching.pop(blob_hash, None)
            else:
                # This caller was cancelled; the download goes on for any that joined it.
                download.add_done_callback(lambda _: self._fetching.pop(blob_hash, None))
        return data

    async def _upload(self, digest: str, output: bytes) -> None:
        if digest in self._uploaded:
            return  # blobs are content-addressed and never deleted: it is still there

        # Straight to PUT, no HEAD first: an output is new to the coordinator almost
        # always, and a PUT of a blob it already has is answered 201 like a new one (the
        # bytes are checked against the hash and the stored file is kept).
        async def put(http: httpx.AsyncClient) -> None:
            response = await http.put(f"/v1/blobs/{digest}", content=output)
            response.raise_for_status()

        await self._with_connection(put)
        if len(self._uploaded) >= UPLOADED_MEMORY:
            self._uploaded.clear()
        self._uploaded.add(digest)

    async def _with_connection(self, call):  # type: ignore[no-untyped-def]
        """Run an HTTP call against the current coordinator, waiting out disconnects.

        While there is no session the call waits for the next one (and runs as soon as it
        is up, not at the next backoff step); failures on a live session back off.
        """
        attempt = 0
        while True:
            if self._stop.is_set():
                raise asyncio.CancelledError()
            http = self._http
            if http is None:
                await self._wait_online()
                continue
            try:
                return await call(http)
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500:
                    raise
                log.info("blob transfer failed (%s); retrying", exc)
            await asyncio.sleep(backoff_delay(attempt, base=0.2, cap=5.0))
            attempt += 1

    async def _wait_online(self) -> None:
        """Until a session is up or the daemon stops, whichever comes first."""
        waits = [asyncio.ensure_future(event.wait()) for event in (self._online, self._stop)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
