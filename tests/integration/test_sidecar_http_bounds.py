"""Issue 25, item 7, against a real `parwatch sidecar` process: a client without the token cannot make
it buffer a body, an oversized head is refused, and 1,100 slow connections under a 1,024 open-file
limit starve neither /healthz nor ingest.

Each of these failed on main before the fix (8fae0f2): the 401 came only after the whole body was
read; a 64 KiB header was accepted (httptools has no cap); the 1,100 connections took every file
descriptor, and new requests on both listeners went unanswered.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import threading
import time

import httpx
import pytest

from tests.fixtures import synthetic as syn
from tests.integration.e2e_util import wait_until
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BODY = 8_000_000
"""Under the default --max-body-bytes (8 MiB): only the token stands between it and the handler."""
HOST_FILE_LIMIT = 1024
"""The usual `ulimit -n` of a host or a container."""
SLOW = 1100


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(url: str, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout)


def _status(sock: socket.socket) -> int:
    """The status code of the answer on `sock` (socket.timeout if none comes)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed without an answer after {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])


def _post_head(length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):  # the resident set's high-water mark
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _assert_ingest_served(sp) -> None:
    """A valid post with the token is answered 200."""
    r = httpx.post(
        f"{sp.control_url}/v1/ingest",
        json={"version": 1, "summaries": [syn.summary(0, 1)]},
        headers=sp.headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text


def _send_unauthenticated(url: str, answers: list) -> None:
    """One 8 MB post without the token, sent whole (if the sidecar lets it); its status or the error."""
    try:
        with _connect(url, timeout=30) as sock:
            with contextlib.suppress(OSError):  # the sidecar may answer and close before the body is in
                sock.sendall(_post_head(BODY) + b"x" * BODY)
            answers.append(_status(sock))
    except OSError as err:
        answers.append(type(err).__name__)


def test_a_body_without_the_token_is_refused_before_it_is_read(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        # The answer needs only the head: 64 KiB of the declared 8 MB are sent, the rest never is.
        with _connect(sp.control_url) as sock:
            sock.sendall(_post_head(BODY) + b"x" * 65536)
            assert _status(sock) == 401

        before = _peak_rss_mb(sp.pid)
        answers: list = []
        senders = [threading.Thread(target=_send_unauthenticated, args=(sp.control_url, answers)) for _ in range(30)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        grown = _peak_rss_mb(sp.pid) - before
        # 30 bodies of 8 MB: buffered, they were +227 to +321 MB (the issue); refused unread, noise.
        assert grown < BODY / 1e6 * 3, (grown, answers)
        assert len(answers) == 30 and set(answers) <= {401, "ConnectionResetError", "BrokenPipeError"}, answers
        assert 401 in answers
        _assert_ingest_served(sp)


@pytest.mark.parametrize("path", ["/v1/ingest", "/v1/activity"])
def test_a_rank_that_dies_mid_post_is_logged_in_one_line_and_changes_nothing(tmp_path, path):
    """A crashed rank's post cut short (half its body, then the connection closed): no traceback in the
    sidecar's log, nothing stored, and the next post is served."""
    with running_sidecar(tmp_path / "state") as sp:
        with _connect(sp.control_url) as sock:
            sock.sendall(_post_head(1000, sp.token).replace(b"/v1/ingest", path.encode()) + b'{"version": 1, "summ')
        wait_until(lambda: "the client went away before its body arrived" in sp.log(), "the one-line log")
        assert "Traceback" not in sp.log(), sp.log()[-3000:]
        status = httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).json()
        assert status["last_step"] is None
        _assert_ingest_served(sp)


@pytest.mark.parametrize("listener", ["control", "metrics"])
def test_an_oversized_head_is_refused_and_the_listener_keeps_answering(tmp_path, listener):
    with running_sidecar(tmp_path / "state") as sp:
        url = sp.control_url if listener == "control" else sp.metrics_url
        with _connect(url) as sock:
            with contextlib.suppress(OSError):  # refused part-way: the rest of the head may not go out
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
            assert _status(sock) in (400, 431)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


@contextlib.contextmanager
def _open_files(n: int):
    """This process may hold n files (the test's own 1,100 sockets), where the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"the hard open-file limit ({hard}) is below the {n} this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _slow_storm(url: str, n: int) -> list[socket.socket]:
    """n connections: half send nothing, half the start of a head and nothing more (a slow loris)."""
    socks = []
    for i in range(n):
        sock = _connect(url)
        if i % 2:
            sock.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(sock)
    return socks


def _closed_by_peer(socks: list[socket.socket], within: float) -> int:
    """How many of `socks` the peer closed (EOF or reset) within `within` seconds."""
    open_ = {s.fileno(): s for s in socks}
    closed = 0
    deadline = time.monotonic() + within
    poller = select.poll()
    for fd in open_:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while open_ and time.monotonic() < deadline:
        for fd, _ in poller.poll(200):
            sock = open_.pop(fd, None)
            if sock is None:
                continue
            poller.unregister(fd)
            try:
                sock.setblocking(False)
                data = sock.recv(4096)
                closed += 1 if not data or b" 503 " in data or b" 408 " in data else 0
            except OSError:
                closed += 1
    return closed


def test_1100_slow_connections_starve_neither_healthz_nor_ingest(tmp_path):
    with _open_files(SLOW + 200), running_sidecar(tmp_path / "state", open_files=HOST_FILE_LIMIT) as sp:
        socks = _slow_storm(sp.control_url, SLOW)
        try:
            with httpx.Client(timeout=5) as client:
                for step in range(1, 4):
                    assert client.get(f"{sp.control_url}/healthz").status_code == 200
                    assert client.get(f"{sp.metrics_url}/healthz").status_code == 200
                    r = client.post(
                        f"{sp.control_url}/v1/ingest",
                        headers=sp.headers,
                        json={"version": 1, "summaries": [syn.summary(0, step)]},
                    )
                    assert r.status_code == 200, r.text
            held = len(os.listdir(f"/proc/{sp.pid}/fd"))
            assert held < HOST_FILE_LIMIT
            # Each slow connection is closed: to make room for a newer one, or when its head is late
            # (head_timeout_seconds, 10 s by default).
            assert _closed_by_peer(socks, within=20.0) == SLOW
        finally:
            for sock in socks:
                sock.close()
        assert "Too many open files" not in sp.log()
