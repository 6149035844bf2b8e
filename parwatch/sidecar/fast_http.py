"""The sidecar's hot POSTs answered at the HTTP protocol, ahead of ASGI.

uvicorn turns every request into an ASGI cycle: a scope, a receive/send message pair per
step, header checks on the way out, and two socket writes (head, then body). The hot posts
(a summary per rank per second at a node's sidecar; a digest per node per second at the
leader: 2,048 a second at 16,384 ranks) are tiny and their handlers are cheap, so that
machinery was most of their cost.

`FastPostProtocol` is uvicorn's httptools protocol with one change: a POST to a path in
`ControlApp.fast_posts` is read, checked and answered here as `ControlApp._fast_post` does it
(body over --max-body-bytes: 413 as soon as it is; then `ControlApp.answer`: wrong or missing
bearer token 401, else the handler's status and JSON), and written in one write.
Everything else (other paths and methods, upgrades, a request pipelined behind an unanswered
one, an app without fast posts) takes uvicorn's own path unchanged. tests/integration/
test_sidecar_fast_http.py holds both paths to the same answers over real sockets.
"""

from __future__ import annotations

import logging
import urllib.parse

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from parwatch.sidecar.app import json_body, too_large

log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Fired:
    """uvicorn's protocol sets the cycle's message_event on connection loss; nothing waits on it here."""

    __slots__ = ()

    def set(self) -> None:
        pass


_FIRED = _Fired()


class _FastCycle:
    """Stands where uvicorn's RequestResponseCycle stands for one fast request: the attributes
    the protocol's own callbacks (connection_lost, shutdown, the next request) read."""

    __slots__ = ("handler", "authorization", "body", "keep_alive", "disconnected", "response_complete")
    message_event = _FIRED

    def __init__(self, handler, authorization: str | None, keep_alive: bool):
        self.handler, self.authorization, self.keep_alive = handler, authorization, keep_alive
        self.body = bytearray()
        self.disconnected = self.response_complete = False


class FastPostProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering ControlApp.fast_posts itself (see the module docstring)."""

    def on_headers_complete(self) -> None:
        cycle = self._fast_cycle()
        if cycle is None:
            return super().on_headers_complete()
        self.cycle = cycle
        if self.expect_100_continue:
            self.transport.write(_CONTINUE)

    def _fast_cycle(self) -> _FastCycle | None:
        fast = getattr(self.app, "fast_posts", None)
        if not fast or self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # pipelined behind an unanswered request: uvicorn queues it
        path = httptools.parse_url(self.url).path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        handler = fast.get(self.root_path + path)
        if handler is None:
            return None
        authorization = None
        for name, value in self.headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        return _FastCycle(handler, authorization, keep_alive)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is not _FastCycle:
            return super().on_body(body)
        if cycle.response_complete:
            return  # answered (413) already: the rest of the body is read and dropped
        cycle.body += body
        limit = self.app.max_body_bytes
        if len(cycle.body) > limit:
            cycle.body = bytearray()
            self._answer(cycle, 413, too_large(limit))

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if type(cycle) is not _FastCycle:
            return super().on_message_complete()
        if cycle.response_complete:
            return
        task = self.loop.create_task(self._run(cycle))
        task.add_done_callback(self.tasks.discard)  # uvicorn's shutdown waits for these
        self.tasks.add(task)

    async def _run(self, cycle: _FastCycle) -> None:
        try:
            status, payload, headers = await self.app.answer(cycle.handler, cycle.authorization, bytes(cycle.body))
        except Exception:  # as uvicorn does for an app's exception: logged, 500
            log.exception("exception in a fast POST handler")
            return self._write(cycle, 500, b"text/plain; charset=utf-8", b"Internal Server Error")
        self._answer(cycle, status, payload, headers)

    def _answer(self, cycle: _FastCycle, status: int, payload, headers: dict | None = None) -> None:
        self._write(cycle, status, b"application/json", json_body(payload), headers)

    def _write(self, cycle: _FastCycle, status: int, content_type: bytes, body: bytes,
               headers: dict | None = None) -> None:
        if cycle.response_complete:
            return
        cycle.response_complete = True
        if cycle.disconnected or self.transport.is_closing():
            return
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"content-type: ", content_type, b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n")
        for name, value in (headers or {}).items():
            head += (name.lower().encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", body)
        self.transport.write(b"".join(head))
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()
