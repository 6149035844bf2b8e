"""The hot POSTs are answered at the HTTP protocol (parwatch.sidecar.fast_http) by a real sidecar.

Over real sockets: every case of tests/unit/test_sidecar_fast_posts.py gets the answer the
framework route gives (status, JSON, token challenge, content type) on one keep-alive
connection; pipelined requests, a chunked body behind `Expect: 100-continue`, HTTP/1.0 and
a framework route on the same connection all still work."""

from __future__ import annotations

import json
import socket

import pytest
from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.process import running_sidecar
from parwatch.sidecar.service import build_sidecar
from tests.unit.test_sidecar_fast_posts import AUTH, CASES, TOKEN, _summary

MAX_BODY = 4096


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    with running_sidecar(tmp_path_factory.mktemp("fast") / "state", "--max-body-bytes", str(MAX_BODY),
                         token=TOKEN) as sp:
        yield sp


def _connect(sp) -> socket.socket:
    host, port = sp.control_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _request(path: str, body: bytes, headers: dict, method: str = "POST", version: str = "1.1") -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: sidecar\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class _Reader:
    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _fill(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        self.buf += chunk
        return chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def response(self) -> tuple[int, dict, bytes]:
        status = int(self.line().split()[1])
        headers: dict = {}
        while line := self.line():
            name, _, value = line.decode("latin-1").partition(":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        length = int(headers.get("content-length", ["0"])[0])
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionError:
            return True


def test_every_case_answers_as_the_framework_route_over_one_connection(sidecar, tmp_path):
    framework_app = create_control_app(build_sidecar(SidecarConfig(state_dir=tmp_path / "framework", token=TOKEN,
                                                                   max_body_bytes=MAX_BODY)))
    framework_app.fast_posts.clear()
    framework = TestClient(framework_app)
    with _connect(sidecar) as sock:
        reader = _Reader(sock)
        for path, raw, headers in CASES:
            sock.sendall(_request(path, raw.encode(), headers))
            status, got_headers, body = reader.response()
            want = framework.post(path, content=raw, headers=headers)
            assert (status, json.loads(body)) == (want.status_code, want.json()), (path, raw[:80])
            assert got_headers["content-type"] == ["application/json"]
            assert got_headers.get("www-authenticate", [None])[0] == want.headers.get("www-authenticate")
            assert len(got_headers["date"]) == 1 and len(got_headers["content-length"]) == 1
            assert "connection" not in got_headers  # still keep-alive, 413 and 401 included


def test_pipelined_requests_are_answered_in_order(sidecar):
    one = _request("/v1/ingest", json.dumps({"version": 1, "summaries": []}).encode(), AUTH)
    bad = _request("/v1/ingest", b"{", AUTH)
    status_page = _request("/v1/status", b"", {"Authorization": AUTH["Authorization"]}, method="GET")
    with _connect(sidecar) as sock:
        sock.sendall(one + bad + status_page + one)
        reader = _Reader(sock)
        got = [reader.response() for _ in range(4)]
    assert [s for s, _, _ in got] == [200, 422, 200, 200]
    assert json.loads(got[0][2])["accepted"] == 0 and "last_step" in json.loads(got[2][2])


def test_a_chunked_body_behind_expect_100_continue(sidecar):
    body = json.dumps({"version": 1, "summaries": [_summary(rank=0, step=50)]}).encode()
    head = ("POST /v1/ingest HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
    with _connect(sidecar) as sock:
        sock.sendall(head.encode())
        reader = _Reader(sock)
        assert reader.line() == b"HTTP/1.1 100 Continue" and reader.line() == b""
        for i in range(0, len(body), 100):
            piece = body[i:i + 100]
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        status, _, answer = reader.response()
    assert (status, json.loads(answer)["accepted"]) == (200, 1)


def test_a_chunked_body_over_the_cap_is_refused_as_it_passes_it(sidecar):
    head = ("POST /v1/digest HTTP/1.1\r\nHost: sidecar\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nTransfer-Encoding: chunked\r\n\r\n")
    with _connect(sidecar) as sock:
        sock.sendall(head.encode() + (b"1000\r\n" + b"x" * 4096 + b"\r\n") * 2)  # no final chunk yet
        reader = _Reader(sock)
        status, _, body = reader.response()  # answered before the body ended
        assert (status, json.loads(body)["detail"]) == (413, f"request body over {MAX_BODY} bytes (--max-body-bytes)")
        sock.sendall(b"0\r\n\r\n" + _request("/v1/ingest", b"{", AUTH))  # the connection is still usable
        assert reader.response()[0] == 422


def test_http_1_0_gets_its_answer_and_the_connection_closes(sidecar):
    with _connect(sidecar) as sock:
        sock.sendall(_request("/v1/ingest", json.dumps({"version": 1, "summaries": []}).encode(), AUTH, version="1.0"))
        reader = _Reader(sock)
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == ["close"]
        assert reader.closed()


def test_the_control_listener_uses_the_fast_protocol_and_the_metrics_listener_does_not(tmp_path):
    from parwatch.sidecar.app import create_metrics_app
    from parwatch.sidecar.fast_http import FastPostProtocol
    from parwatch.sidecar.server import _uvicorn

    built = build_sidecar(SidecarConfig(state_dir=tmp_path / "s", token=TOKEN))
    assert _uvicorn(create_control_app(built), "on").config.http is FastPostProtocol
    assert _uvicorn(create_metrics_app(built), "off").config.http == "httptools"
