"""parwatch.sidecar.listener: a listener's connection book (count, head time and head size bounds),
over fake transports; tests/integration/test_sidecar_http_bounds.py holds a real sidecar to them."""

from __future__ import annotations

import asyncio

from parwatch.sidecar.listener import Book, Guarded, Watch


class Transport:
    def __init__(self, port: int):
        self.port, self.written, self.closed = port, b"", False

    def get_extra_info(self, name):
        return ("127.0.0.1", self.port) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes = getattr(self, "writes", 0) + 1

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class Inner:
    def __init__(self):
        self.received = b""

    def connection_made(self, transport):
        pass

    def data_received(self, data):
        self.received += data

    def connection_lost(self, exc):
        pass


def _connect(book: Book, port: int) -> tuple[Guarded, Transport]:
    conn, transport = Guarded(book, Inner()), Transport(port)
    conn.connection_made(transport)
    return conn, transport


def run(coro):
    return asyncio.run(coro)


def test_a_head_split_anywhere_within_the_cap_passes_and_its_body_is_not_counted():
    async def main():
        book = Book(8, 10.0, max_head_bytes=64)
        head = b"POST /v1/digest HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
        assert len(head) <= 64
        for cut in range(1, len(head)):
            conn, transport = _connect(book, 1000 + cut)
            for piece in (head[:cut], head[cut:], b"x" * 500):
                conn.data_received(piece)
            assert not transport.closed and conn.inner.received == head + b"x" * 500, cut
            conn.connection_lost(None)

    run(main())


def test_a_head_over_the_cap_gets_431_and_the_connection_closes():
    async def main():
        book = Book(8, 10.0, max_head_bytes=64)
        for pieces in (
            [b"GET / HTTP/1.1\r\nX: " + b"a" * 100],
            [b"GET / HTTP/1.1\r\n", b"X: " + b"a" * 60, b"\r\n\r\n"],
            [b"GET / HTTP/1.1\r\nX: " + b"a" * 100 + b"\r\n\r\n"],
        ):
            conn, transport = _connect(book, 2000 + len(pieces))
            for piece in pieces:
                conn.data_received(piece)
            assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.closed
            conn.connection_lost(None)
            assert len(book) == 0

    run(main())


def test_a_full_listener_closes_its_longest_waiting_connection_never_one_being_answered():
    async def main():
        book = Book(2, 10.0, max_head_bytes=1024)
        first, first_t = _connect(book, 1)
        second, second_t = _connect(book, 2)
        book.serve(("127.0.0.1", 1))  # the first one's request reached the app
        third, third_t = _connect(book, 3)
        assert second_t.closed and not first_t.closed and not third_t.closed
        book.serve(("127.0.0.1", 3))
        fourth, fourth_t = _connect(book, 4)  # every open connection is being answered: 503
        assert fourth_t.written.startswith(b"HTTP/1.1 503 ") and fourth_t.closed
        assert not first_t.closed and not third_t.closed

    run(main())


def test_a_connection_that_sends_no_head_in_time_is_closed_and_an_answer_restarts_the_clock():
    async def main():
        book = Book(8, 0.05, max_head_bytes=1024)
        idle, idle_t = _connect(book, 1)
        served, served_t = _connect(book, 2)
        book.serve(("127.0.0.1", 2))
        await asyncio.sleep(0.1)
        assert idle_t.closed and not served_t.closed  # a request being answered is not timed
        book.answered(("127.0.0.1", 2), body_read=True)
        await asyncio.sleep(0.1)
        assert served_t.closed  # then it waited for its next head too long

    run(main())


def test_watch_closes_a_connection_answered_before_its_body_was_read():
    async def main():
        book = Book(8, 10.0, max_head_bytes=1024)
        conn, transport = _connect(book, 7)

        async def refuse(scope, receive, send):  # answers without reading the body (as a 401 does)
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"no"})

        async def nothing(message):
            pass

        scope = {"type": "http", "client": ("127.0.0.1", 7), "headers": [(b"content-length", b"8000000")]}
        await Watch(refuse, book)(scope, None, nothing)
        assert transport.closed and len(book) == 0

    run(main())


def test_an_answers_head_and_body_written_in_one_turn_go_out_in_one_write():
    """uvicorn's protocol writes an answer's head, then its body: one send (one wake-up of the client)."""

    class Keeps(Inner):
        def connection_made(self, transport):
            self.transport = transport

    async def main():
        conn, raw = Guarded(Book(8, 10.0, max_head_bytes=1024), Keeps()), Transport(1)
        conn.connection_made(raw)
        uvicorns = conn.inner.transport  # what uvicorn's protocol was given
        uvicorns.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        uvicorns.write(b"ok")
        await asyncio.sleep(0)
        assert (raw.written, raw.writes) == (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 1)
        uvicorns.write(b"last")
        uvicorns.close()  # what was written before a close goes out before it
        assert raw.written.endswith(b"oklast") and raw.writes == 2 and raw.closed
        assert uvicorns.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's own

    run(main())
