"""Issue 43, findings 11, 12 and 13 (the HTTP face), against a real sidecar: a body has a deadline as its head
has; nesting 1,000 deep is a 422, never a 500; every refusal's log line says why; the OpenAPI document needs
the token; a large hot post is decoded off the event loop."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.integration.e2e_util import wait_until
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
DEEP = "[" * 1000 + "]" * 1000


def _stalled(sp, path: str = "/v1/ingest") -> socket.socket:
    """A connection whose request head and token arrived, and 10 of its body's 1,000 bytes."""
    host, port = sp.control_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {sp.token}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"version"')
    return sock


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_body_that_never_completes_is_closed_at_its_deadline(tmp_path):
    """Finding 11: a request whose body never completed was never timed out once authenticated: 20 of 20 still
    open after 75 s, and 100 of them made every control request 503 for as long as they stayed. The empty
    reason of the refusal's log line (finding 13) is checked here too."""
    with running_sidecar(tmp_path / "state", "--body-timeout-seconds", "1", open_files=200) as sp:
        stalled = [_stalled(sp) for _ in range(100)]  # more than a listener of 200 open files holds (68)
        try:
            assert wait_until(lambda: all(_closed(s) for s in stalled), "the stalled bodies closed", timeout=10)
            assert httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).status_code == 200
        finally:
            for s in stalled:
                s.close()
        gone = _stalled(sp)
        gone.close()  # a client that went away mid-body: answered 400, and its log line says why
        wait_until(lambda: "refused ranks' summaries (HTTP 400" in sp.log(), "the refusal logged", timeout=10)
        line = next(x for x in sp.log().splitlines() if "refused ranks' summaries (HTTP 400" in x)
        assert line.split("): ", 1)[1].strip(), line


def test_deep_nesting_is_a_422_and_openapi_needs_the_token(tmp_path):
    """Finding 12: nesting 1,000 deep (2.4 KB) answered 500 with a RecursionError traceback on activity and
    ingest. Finding 13: /openapi.json was open without a token."""
    with running_sidecar(tmp_path / "state") as sp:
        bodies = {
            "/v1/activity": '{"version": 1, "activity": ' + DEEP + "}",
            "/v1/ingest": '{"version": 1, "summaries": [' + DEEP + "]}",
            "/v1/digest": '{"version": 1, "node": "n", "run_id": "r", "time": 1, "layout": [1, 1, 1], "rows": '
            + DEEP
            + "}",
            "/v1/control": '{"action": ' + DEEP + "}",
        }
        for path, body in bodies.items():
            r = httpx.post(f"{sp.control_url}{path}", content=body, headers=sp.headers, timeout=10)
            assert r.status_code == 422, (path, r.status_code, r.text[:300])
        assert "Traceback" not in sp.log() and "RecursionError" not in sp.log()
        assert httpx.get(f"{sp.control_url}/openapi.json", timeout=10).status_code == 401
        assert "/v1/ingest" in httpx.get(f"{sp.control_url}/openapi.json", headers=sp.headers).json()["paths"]
    with running_sidecar(tmp_path / "open", "--open-openapi") as sp:
        assert httpx.get(f"{sp.control_url}/openapi.json", timeout=10).status_code == 200


def _big_digest(ranks: int) -> bytes:
    now = time.time()
    rows = [
        [
            r,
            "running",
            "forward",
            None,
            None,
            None,
            None,
            now - 1,
            5,
            0.2,
            1000 + r,
            f"host-{r // 8}",
            0,
            0,
            r,
            now,
            None,
        ]
        for r in range(ranks)
    ]
    body = {"version": 1, "node": "big", "run_id": "r", "time": now, "layout": [1, 1, ranks], "rows": rows}
    return json.dumps(body).encode()


@pytest.mark.timing
def test_large_digests_do_not_hold_the_event_loop(tmp_path):
    """Finding 12: 7.4 MiB digests back to back held the event loop 1.6 s each (control /healthz p99 1.5 s).
    Decoded in a thread now, and a digest of more rows than a node serves (--max-ranks) is refused before its
    rows are read. msgspec holds the GIL while it decodes (~80 ms for 7.4 MiB on a quiet core): that is what
    is left, hence 0.5 s here on a shared, loaded host (d484f20 on the same host: 0.75-1.2 s)."""
    raw = _big_digest(55_000)  # ~7.4 MiB, under the 8 MiB body cap
    with running_sidecar(tmp_path / "state") as sp:
        stop, latencies = threading.Event(), []

        def probe():
            with httpx.Client(timeout=10) as client:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    client.get(f"{sp.control_url}/healthz")
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        thread = threading.Thread(target=probe)
        thread.start()
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                client.post(f"{sp.control_url}/v1/digest", content=raw, headers=sp.headers)
        stop.set()
        thread.join()
    assert statistics.quantiles(latencies, n=100)[98] < 0.5, sorted(latencies)[-5:]
