"""Bounds on one listener's connections, which uvicorn does not set: how many are open, how long
one may take to send a request's head, and how large that head may be.

uvicorn's `limit_concurrency` answers 503 only once a request's head has arrived, so connections
that never send one hold their file descriptors (1,100 of them exhausted a 1,024 limit and every
request on both listeners failed). Its keep-alive timeout starts only after an answer, and is
cancelled by the first byte of the next request: nothing times a slowly sent head. Its httptools
parser has no cap on a head's size (a 64 MB header was read whole).

`Guarded` wraps uvicorn's protocol (composition: only asyncio.Protocol's public methods) and
keeps a book of the listener's connections:
- at most `max_connections` open: a new one closes the connection that has waited longest for
  its next request (a slow or idle one; one being answered is never closed), or gets a 503 when
  every connection is busy;
- each connection must deliver a request's head within `head_seconds` of connecting or of its
  last answer, else it is closed; a head over `max_head_bytes` (up to the blank line that ends
  it) gets a 431 and the connection is closed.
- a request's body must have arrived whole within `body_seconds` of its head, else the connection
  is closed (an authenticated client whose body never completed held its connection, and a slot of
  the listener, for good: 100 such made every other request a 503).
`Corked` is the transport uvicorn's protocol writes to: what it writes in one turn of the event loop
goes out in one send. uvicorn writes an answer's head and its body separately, so a small answer cost
two socket writes and woke its client twice; at the leader, 2,048 digests a second, those writes were
23% of the loop's busy time (docs/benchmarks.md, "Where the leader's event loop goes").
`Watch` (ASGI middleware) tells the book when a request reached the app (its head is in), when its
body was read whole and when its answer went out, by the client address both sides see (the socket's
peer name). A request answered before its body was read closes its connection: what follows is
body, not a head.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

Peer = tuple[str, int]
"""A connection's (host, port), as the socket's peer name and the ASGI scope's `client` both give it."""

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 32\r\nconnection: close\r\n\r\nevery connection is busy; retry\n"
)
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 31\r\nconnection: close\r\n\r\nrequest head over the size cap\n"
)


class Book:
    """The open connections of one listener, in order of how long they have waited for a request."""

    def __init__(
        self,
        max_connections: int,
        head_seconds: float,
        max_head_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        body_seconds: float = 30.0,
        on_close: Callable[[Peer], None] | None = None,
    ):
        self.max_connections, self.head_seconds, self.clock = max_connections, head_seconds, clock
        self.max_head_bytes, self.body_seconds = max_head_bytes, body_seconds
        self.on_close = on_close
        """Told the peer of every connection that closes (what was proven of it: pid_owner.Proofs)."""
        self.waiting: dict[Guarded, float] = {}
        """Connections between requests -> since when (insertion order: the oldest first)."""
        self.busy: set[Guarded] = set()
        self.by_peer: dict[Peer, Guarded] = {}
        """Connections by peer name; one without a peer name cannot be matched to its requests."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.busy)

    def admit(self, conn: Guarded) -> bool:
        """Room for `conn`, closing the longest-waiting connection if the listener is full; False
        when every open connection is being answered."""
        if len(self) >= self.max_connections:
            if not self.waiting:
                return False
            next(iter(self.waiting)).close()
        if conn.peer is not None:
            self.by_peer[conn.peer] = conn
        self.wait(conn)
        return True

    def wait(self, conn: Guarded) -> None:
        self.busy.discard(conn)
        self.waiting.pop(conn, None)
        self.waiting[conn] = self.clock()
        conn.expect_head(self.head_seconds)

    def serve(self, peer: Peer, has_body: bool = False) -> None:
        """A request's head is in: no head deadline while it is served, a body deadline while its body comes."""
        conn = self.by_peer.get(peer)
        if conn is not None and self.waiting.pop(conn, None) is not None:
            self.busy.add(conn)
            conn.disarm()
            if has_body:
                conn.expect_body(self.body_seconds)

    def body_read(self, peer: Peer) -> None:
        conn = self.by_peer.get(peer)
        if conn is not None and conn in self.busy:
            conn.disarm()

    def answered(self, peer: Peer, body_read: bool) -> None:
        conn = self.by_peer.get(peer)
        if conn is not None and conn in self.busy:
            if body_read:
                self.wait(conn)
            else:
                conn.close()

    def leave(self, conn: Guarded) -> None:
        self.waiting.pop(conn, None)
        self.busy.discard(conn)
        if conn.peer is not None and self.by_peer.get(conn.peer) is conn:
            del self.by_peer[conn.peer]
            if self.on_close is not None:
                self.on_close(conn.peer)


class Corked:
    """A transport whose writes of one turn of the loop are joined into one write at its end (or at
    close). Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class Guarded:
    """asyncio.Protocol: uvicorn's protocol for one connection, admitted and timed by a Book."""

    def __init__(self, book: Book, inner: asyncio.Protocol):
        self.book = book
        self.inner: asyncio.Protocol | None = inner
        self.transport: Corked | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.peer: Peer | None = None
        self.head_bytes: int | None = None
        """Bytes of the next request's head received so far; None once it is complete."""
        self.tail = b""  # the last 3 bytes scanned: the blank line may be split across reads

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = corked = Corked(transport)
        self.peer = _key(transport.get_extra_info("peername"))
        if not self.book.admit(self):
            corked.write(BUSY)
            corked.close()
            self.inner = None
            return
        assert self.inner is not None  # only a refused connection drops it, above
        self.inner.connection_made(corked)  # type: ignore[arg-type]  # a Transport in all it uses

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.head_bytes is not None:
            scanned = self.tail + data
            end = scanned.find(b"\r\n\r\n")
            size = self.head_bytes + (len(data) if end < 0 else end + 4 - len(self.tail))
            if size > self.book.max_head_bytes:
                assert self.transport is not None  # connection_made, which set it, comes first
                self.transport.write(HEAD_TOO_LARGE)
                return self.close()
            self.head_bytes, self.tail = (size, scanned[-3:]) if end < 0 else (None, b"")
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.book.leave(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def expect_head(self, seconds: float) -> None:
        self.disarm()
        self.head_bytes, self.tail = 0, b""
        self.timer = asyncio.get_running_loop().call_later(seconds, self.close)

    def expect_body(self, seconds: float) -> None:
        self.disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, self.close)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close(self) -> None:
        self.disarm()
        self.book.leave(self)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def guarded(protocol_class, book: Book):
    """A protocol factory for uvicorn.Config(http=...): `protocol_class(**uvicorn's arguments)`, guarded."""

    def make(**kwargs) -> Guarded:
        return Guarded(book, protocol_class(**kwargs))

    return make


class Watch:
    """ASGI middleware: tells the Book when a request reached the app and when its answer was sent."""

    def __init__(self, app, book: Book):
        self.app, self.book = app, book

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        peer = _key(scope.get("client"))
        if peer is None:  # no peer name: no connection in the book to tell
            return await self.app(scope, receive, send)
        body_read = not _has_body(scope)
        self.book.serve(peer, has_body=not body_read)

        async def received():
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and not body_read:
                body_read = True
                self.book.body_read(peer)
            return message

        async def sent(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.book.answered(peer, body_read)

        await self.app(scope, received, sent)


def _has_body(scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name == b"transfer-encoding" or name == b"content-length" and value.strip() not in (b"0", b""):
            return True
    return False


def _key(address: object) -> Peer | None:
    """(host, port) of a peer name (IPv6 peer names have four fields), as uvicorn puts it in the scope."""
    if isinstance(address, (list, tuple)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None
