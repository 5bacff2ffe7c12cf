"""How `idlegrid serve` runs the app under uvicorn, with limits per connection.

uvicorn alone leaves a client four ways to hold memory or sockets, closed here by
subclasses of its protocols (HTTP on httptools, WebSocket on websockets' sans-I/O core):

- A connection that never finishes its request head is kept forever (slowloris):
  the head must arrive whole within `request_head_timeout_s` of the connection opening
  (or of the previous response), however slowly its bytes trickle in.
- httptools buffers a request head of any size: past `max_request_head_bytes` the
  request is answered 431 and the connection closed.
- `ws_max_size` is one limit for every socket, authenticated or not: a node socket reads
  frames of at most `hello_max_bytes` until the app raises the limit, after the hello
  (`nodes.FRAME_LIMIT_EXTENSION`). A frame over the limit is refused on its header,
  before its payload is read, and the socket closed with 1009.
- Any number of connections from one address: past `max_connections_per_address` a new
  one is answered 429 and closed before anything of it is read.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request as HandshakeRequest

from idlegrid.coordinator.node_socket import FRAME_LIMIT_EXTENSION
from idlegrid.settings import CoordinatorSettings


class ConnectionTable:
    """Open connections per client address (HTTP, and WebSocket after the upgrade)."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._by_address: dict[str, set[asyncio.BaseTransport]] = {}
        self._address_of: dict[asyncio.BaseTransport, str] = {}

    def admit(self, address: str, transport: asyncio.BaseTransport) -> bool:
        """Count the connection in, unless its address is at the cap (then False)."""
        open_ones = self._by_address.setdefault(address, set())
        if self.per_address > 0 and len(open_ones) >= self.per_address:
            if not open_ones:
                del self._by_address[address]
            return False
        open_ones.add(transport)
        self._address_of[transport] = address
        return True

    def release(self, transport: asyncio.BaseTransport) -> None:
        """Count it out (a connection never admitted, or released already: nothing)."""
        address = self._address_of.pop(transport, None)
        if address is None:
            return
        open_ones = self._by_address[address]
        open_ones.discard(transport)
        if not open_ones:
            del self._by_address[address]

    def count(self, address: str) -> int:
        return len(self._by_address.get(address, ()))


def _plain_response(status: int, phrase: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


@dataclass(frozen=True)
class ConnectionLimits:
    """What the guarded protocols enforce, from the coordinator's settings."""

    table: ConnectionTable
    head_timeout_s: float
    max_head_bytes: int
    hello_max_bytes: int


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's HTTP protocol with a deadline and a size cap on each request head, and a
    cap on connections per address; `protocols` binds the limits."""

    limits: ConnectionLimits
    _head_timer: asyncio.TimerHandle | None = None
    _awaiting_head = True
    _head_bytes = 0  # bytes received since the head began (a head still arriving)
    _head_size = 0  # its request line and headers as parsed (a head that ended)
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        if not self.limits.table.admit(address, transport):
            message = (
                f"{self.limits.table.count(address)} connections from this address are open "
                f"(max_connections_per_address {self.limits.table.per_address})"
            )
            self._refuse(429, "Too Many Requests", message)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self.limits.table.release(self.transport)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # Counted before parsing, judged after: the parser clears `_awaiting_head`
        # when the head ends, so body bytes in the same chunk never count.
        if self._awaiting_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > self.limits.max_head_bytes:
            self._refuse_large_head()

    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._cancel_head_timer()
        if self._head_size > self.limits.max_head_bytes:  # it came whole, in one read
            self._refuse_large_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._awaiting_head, self._head_bytes = True, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._awaiting_head and not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head, on a kept-alive connection

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_overdue)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self._head_bytes:
            message = f"request head not complete within {self.limits.head_timeout_s:g} s"
            self._refuse(408, "Request Timeout", message)
        else:
            self.transport.close()

    def _refuse_large_head(self) -> None:
        message = f"request head over {self.limits.max_head_bytes} bytes (max_request_head_bytes)"
        self._refuse(431, "Request Header Fields Too Large", message)

    def _refuse(self, status: int, phrase: str, message: str) -> None:
        self._refused = True
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_plain_response(status, phrase, message))
            self.transport.close()


class GuardedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol with a frame limit the app raises after the hello, and
    the per-address count of its HTTP upgrade released when it ends."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._set_frame_limit(self.limits.hello_max_bytes)

    def handle_connect(self, event: HandshakeRequest) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:  # the app runs: let it raise the limit
            self.scope["extensions"][FRAME_LIMIT_EXTENSION] = {  # type: ignore[index]
                "set": self._set_frame_limit
            }

    def _set_frame_limit(self, limit: int) -> None:
        # Read on each frame's header: a frame over it is refused before its payload.
        self.conn.max_message_size = limit

    def connection_lost(self, exc: Exception | None) -> None:
        self.limits.table.release(self.transport)
        super().connection_lost(exc)


def protocols(
    settings: CoordinatorSettings, table: ConnectionTable
) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """The HTTP and WebSocket protocol classes for uvicorn, bound to these limits."""
    limits = ConnectionLimits(
        table=table,
        head_timeout_s=settings.request_head_timeout_s,
        max_head_bytes=settings.max_request_head_bytes,
        hello_max_bytes=settings.hello_max_bytes,
    )
    http = type("BoundGuardedHttp", (GuardedHttp,), {"limits": limits})
    ws = type("BoundGuardedWebSocket", (GuardedWebSocket,), {"limits": limits})
    return http, ws


def uvicorn_config(app: Any, settings: CoordinatorSettings, *, log_level: str) -> uvicorn.Config:
    """uvicorn's settings for the coordinator app."""
    http, ws = protocols(settings, ConnectionTable(settings.max_connections_per_address))
    return uvicorn.Config(
        app,
        http=http,
        ws=ws,
        log_level=log_level,
        lifespan="on",
        access_log=log_level == "debug",
        ws_max_size=settings.max_frame_bytes,
        # Node messages are small JSON: deflate would cost CPU and a zlib context per node.
        ws_per_message_deflate=False,
        # Nodes send heartbeats (acknowledged) and silent ones are closed after the node
        # timeout: WebSocket pings from this side would double the frames of an idle fleet.
        ws_ping_interval=None,
        timeout_keep_alive=max(1, math.ceil(settings.keep_alive_timeout_s)),
        proxy_headers=True,
        forwarded_allow_ips=list(settings.trusted_proxies),
        timeout_graceful_shutdown=5,
    )
