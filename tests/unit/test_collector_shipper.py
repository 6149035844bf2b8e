"""Shipping summaries: a real local HTTP sidecar, a sidecar that is down, and one that hangs."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_collector_sim import SimRank, SimRun, ctx_for, pipeline, run_steps

from parwatch.credentials import rank_credential
from parwatch.ports import free_port
from tests.deadline import wait_until

WAIT_S = 30.0  # generous: other helpers load this 2-core machine


def wait_for(predicate, what: str):
    wait_until(predicate, what, WAIT_S, interval=0.01)


class FakeSidecar:
    """http.server on a free loopback port that records ingests and answers with a directive (the ranks'
    activity reports, the first at attach, are kept apart)."""

    def __init__(self, directive=None) -> None:
        self.requests: list[tuple[str, dict, dict]] = []
        self.activity: list[dict] = []
        self.directive = directive
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/activity":
                    sidecar.activity.append(body)
                else:
                    sidecar.requests.append((self.path, dict(self.headers), body))
                # An ingest body without summaries (rank 0's outcome or check records alone) omits the field.
                reply = json.dumps(
                    {"accepted": len(body.get("summaries", ())), "directive": sidecar.directive}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def ingested(self) -> list[dict]:
        return [s for _, _, body in self.requests for s in body.get("summaries", ())]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sidecar():
    server = FakeSidecar()
    yield server
    server.close()


def started(**kw):
    run = pipeline(p=2, m=4, **kw)
    run.boundary(0, "start", 0.0, 0.1)
    return run


def test_summaries_reach_the_sidecar_with_the_token_and_its_directive_reaches_rank_0(sidecar):
    sidecar.directive = {
        "id": 5,
        "action": "pause",
        "run_id": "sim-run",
        "to_step": None,
        "skip_batches": 0,
        "reason": "operator",
    }
    run = started(endpoint=sidecar.url, token="s3cret")
    run_steps(run, 3, 0.1)
    wait_for(lambda: len(sidecar.ingested()) == 6, "6 summaries at the sidecar")
    path, headers, body = sidecar.requests[0]
    assert path == "/v1/ingest" and body["version"] == 1
    for _, headers, body in sidecar.requests:  # each rank sends its own credential, never the secret it came from
        ranks = {s["rank"] for s in body.get("summaries", ())} or {0}  # records alone: rank 0's
        assert len(ranks) == 1 and headers["Authorization"] == f"Bearer {rank_credential('s3cret', 'sim-run', *ranks)}"
    assert sorted((s["rank"], s["step"]) for s in sidecar.ingested()) == [(r, n) for r in (0, 1) for n in (1, 2, 3)]
    rank0 = run.ranks[0].collector
    wait_for(lambda: rank0.directives._latest is not None, "the directive at rank 0")
    directive = rank0.pending_directive()
    assert (directive.id, directive.action, directive.reason) == (5, "pause", "operator")
    assert rank0.pending_directive() is None
    for rank in run.ranks:
        rank.collector.close(timeout=WAIT_S)
    assert [r.collector.shipper.sent for r in run.ranks] == [3, 3]
    assert [r.collector.dropped_total for r in run.ranks] == [0, 0]


def test_rank_0_polls_with_empty_ingests_while_no_summaries_flow(sidecar):
    run = started(endpoint=sidecar.url, poll_interval_s=0.05)
    # paused: heartbeats only, no summaries; the resume must still be able to arrive
    for i in range(3):
        run.boundary(0, "heartbeat", 1.0 + i, 1.5 + i)
    wait_for(lambda: any(body["summaries"] == [] for _, _, body in sidecar.requests), "an empty poll")
    sidecar.directive = {
        "id": 8,
        "action": "resume",
        "run_id": "sim-run",
        "to_step": None,
        "skip_batches": 0,
        "reason": "",
    }
    rank0 = run.ranks[0].collector
    wait_for(lambda: rank0.directives._latest is not None, "the resume directive")
    assert run.boundary(0, "resume", 5.0, 5.5).action == "resume"
    assert all(r.collector.summaries == 0 for r in run.ranks)
    for rank in run.ranks:
        rank.collector.close(timeout=WAIT_S)


def test_sidecar_down_drops_and_counts_summaries_and_training_goes_on():
    run = started(endpoint=f"http://127.0.0.1:{free_port()}")  # bound a moment ago, nothing listens there
    t = run_steps(run, 5, 0.1)
    rank0 = run.ranks[0].collector
    wait_for(lambda: rank0.dropped_total == 5, "5 dropped summaries")
    run_steps(run, 1, t, first_step=6)
    assert rank0.last_summary.dropped_total == 5  # reported in the next summary
    for rank in run.ranks:
        rank.collector.close(timeout=WAIT_S)
    assert rank0.shipper.sent == 0 and rank0.dropped_total == 6


class HungPoster:
    """An HTTP client whose first POST never answers until released: a sidecar that hangs."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def post(self, url, content, headers):
        self.calls += 1
        self.entered.set()
        self.release.wait()
        raise ConnectionError("sidecar hung up")


@pytest.mark.timeout(120)
def test_hung_sidecar_never_blocks_boundaries_and_the_queue_drops_the_oldest():
    poster = HungPoster()
    run = SimRun(
        [SimRank(ctx_for(0), endpoint="http://sidecar.invalid", http=poster, queue_size=4), SimRank(ctx_for(1))]
    )
    run.boundary(0, "start", 0.0, 0.1)
    t = run_steps(run, 1, 0.1)
    assert poster.entered.wait(WAIT_S)  # rank 0's shipper thread is stuck inside its first POST
    rank0 = run.ranks[0].collector
    run_steps(run, 20, t, first_step=2)  # returns although the shipper cannot move
    assert rank0.summaries == 21
    assert rank0.shipper.queued() == 4
    assert rank0.dropped_total == 16  # 20 queued behind the stuck POST, 4 kept
    assert rank0.last_summary.dropped_total == 15  # counted before its own put displaced one more
    poster.release.set()
    for rank in run.ranks:
        rank.collector.close(timeout=WAIT_S)
    assert rank0.dropped_total == 21  # the stuck batch and the 4 kept ones failed too (backoff)
