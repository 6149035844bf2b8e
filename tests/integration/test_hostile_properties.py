"""Property tests against a real sidecar process (issue 25): whatever activity rows, node digests and control
bodies an authenticated client sends, the sidecar answers below 500, /healthz keeps answering within
100 ms (p99 over the whole session), and its RSS stays under 300 MB."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parwatch.records import ACTIVITY_FIELDS
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
EXAMPLES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
HEALTHZ_P99_S, RSS_MB = 0.100, 300.0

numbers = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 2**31, 2**53, 10**18, 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=80))
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=8), scalars, max_size=3))
layouts = st.lists(st.one_of(st.integers(-2, 8), st.sampled_from([10**6, 2**40])), min_size=0, max_size=4)


@st.composite
def activity_bodies(draw):
    row = {f: draw(values) for f in ACTIVITY_FIELDS}
    if draw(st.booleans()):  # near a real report: a small layout and a rank in it
        tp, pp, dp = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
        rank = draw(st.integers(0, tp * pp * dp - 1))
        row.update(
            run_id="prop",
            tp=tp,
            pp=pp,
            dp=dp,
            rank=rank,
            state=draw(st.sampled_from(["running", "done", "crashed", "x"])),
            step=draw(st.integers(-2, 10**12)),
            time=time.time(),
        )
    return {"version": draw(st.sampled_from([1, 1, 2, "1", None])), "activity": row}


@st.composite
def digest_bodies(draw):
    rows = draw(st.lists(st.lists(values, max_size=20), max_size=6))
    return {
        "version": draw(st.sampled_from([1, 1, 0])),
        "node": draw(st.one_of(st.text(max_size=40), values)),
        "run_id": draw(st.one_of(st.just("prop"), values)),
        "time": draw(values),
        "layout": draw(layouts),
        "rows": rows,
    }


@st.composite
def control_bodies(draw):
    body = {
        "action": draw(st.one_of(st.sampled_from(["pause", "resume", "rollback"]), values)),
        "reason": draw(st.one_of(st.text(max_size=200), values)),
    }
    for key in ("to_step", "skip_batches", "requested_by"):
        if draw(st.booleans()):
            body[key] = draw(values)
    return body


class Watch:
    """The sidecar under test, with /healthz timed after every post."""

    def __init__(self, sp):
        self.sp, self.client, self.healthz = sp, httpx.Client(timeout=10), []

    def post(self, path: str, body) -> int:
        r = self.client.post(
            f"{self.sp.control_url}{path}",
            content=json.dumps(body),
            headers={**self.sp.headers, "content-type": "application/json"},
        )
        t0 = time.perf_counter()
        assert self.client.get(f"{self.sp.control_url}/healthz").status_code == 200
        self.healthz.append(time.perf_counter() - t0)
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
        return r.status_code

    def rss_mb(self) -> float:
        with open(f"/proc/{self.sp.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def watch(tmp_path_factory):
    with running_sidecar(tmp_path_factory.mktemp("props") / "state") as sp:
        w = Watch(sp)
        yield w
        w.client.close()
        assert "Traceback" not in sp.log(), sp.log()[-3000:]


@EXAMPLES
@given(body=activity_bodies())
def test_any_activity_report_is_answered_below_500(watch, body):
    watch.post("/v1/activity", body)


@EXAMPLES
@given(body=digest_bodies())
def test_any_digest_is_answered_below_500(watch, body):
    watch.post("/v1/digest", body)


@EXAMPLES
@given(body=control_bodies())
def test_any_control_body_is_answered_below_500(watch, body):
    watch.post("/v1/control", body)


def test_the_sidecar_stayed_responsive_and_small(watch):
    """After the three properties above (this module's order): /healthz p99 and the sidecar's RSS."""
    assert len(watch.healthz) >= 300
    p99 = statistics.quantiles(watch.healthz, n=100)[98]
    assert p99 <= HEALTHZ_P99_S, p99
    assert watch.rss_mb() <= RSS_MB
