"""One HTTP path, no smuggling, against a real sidecar process (issue 25, item 9). On 8fae0f2 the fast path
and uvicorn disagreed: with two Authorization headers the fast path used the last and uvicorn the first
(wrong + right: 200 on one path, 401 on another), and a request smuggled behind Content-Length +
Transfer-Encoding was executed on the h11 fallback. Now every path reads the first header, and a body framed
both ways is a 400 that closes the connection, so nothing after it on that connection runs."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _raw(port: int, request: bytes) -> bytes:
    """Send raw bytes on one connection; everything the sidecar answers before it closes (or 3 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def _port(sp) -> int:
    return int(sp.control_url.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", ["/v1/digest", "/v1/activity", "/v1/ingest", "/v1/control"])
def test_two_authorization_headers_are_read_alike_on_every_path(tmp_path, path):
    with running_sidecar(tmp_path / "state") as sp:
        right = sp.headers["Authorization"]
        body = b'{"version": 1}'
        for first, second, refused in (("Bearer wrong", right, True), (right, "Bearer wrong", False)):
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {first}\r\nAuthorization: {second}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            status = int(_raw(_port(sp), head.encode() + body).split(b" ", 2)[1])
            assert (status == 401) == refused, (path, first, status)


def test_a_request_smuggled_behind_two_framings_never_runs(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        token = sp.headers["Authorization"]
        pause = json.dumps({"action": "pause", "reason": "smuggled"}).encode()
        smuggled = (
            f"POST /v1/control HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(pause)}\r\n\r\n"
        ).encode() + pause
        body = b"0\r\n\r\n" + smuggled
        head = (
            f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        answer = _raw(_port(sp), head + body)
        decisions = httpx.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=10).json()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # one answer: the connection closed after it
    assert not [d for d in decisions if d.get("reason") == "smuggled"], decisions
