"""Issue 25's activity and digest cases, against a real `parwatch sidecar` process: a rank's token
is enough to post them, so every field is checked against the run's layout and a real run's bounds.

On 40e8301 a layout of 10^6 x 10^6 x 10^6 wedged the leader (RSS 10.5 GB in 24 s), a digest row
whose `time` was a string made every hang tick fail, 1e400 answered 500, and these endpoints
answered 400 where the others answer 422. Each must now be a 422 naming the field, with /healthz
and /metrics answering and no traceback in the sidecar's log.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def activity(rank=0, tp=1, pp=2, dp=1, **change) -> dict:
    a = {
        "run_id": "r1",
        "rank": rank,
        "pid": 10_000 + rank,
        "host": "elsewhere",
        "stage": rank,
        "tp_rank": 0,
        "dp_rank": 0,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "state": "running",
        "step": 3,
        "step_seconds": 0.1,
        "kind": "forward",
        "op": None,
        "group": None,
        "peer": None,
        "seq": None,
        "since": time.time() - 1,
        "time": time.time(),
    }
    a.update(change)
    return {"version": 1, "activity": a}


def row(rank=1, **change) -> list:
    r = {
        "rank": rank,
        "state": "running",
        "kind": "forward",
        "op": None,
        "group": None,
        "peer": None,
        "seq": None,
        "since": time.time() - 1,
        "step": 3,
        "step_seconds": 0.1,
        "pid": 20_000 + rank,
        "host": "node-b",
        "stage": rank,
        "tp_rank": 0,
        "dp_rank": 0,
        "time": time.time(),
        "step_end": time.time() - 2,
    }
    r.update(change)
    return list(r.values())


def digest(rows, layout=(1, 2, 1), node="node-b:9401", run_id="r1") -> dict:
    return {"version": 1, "node": node, "run_id": run_id, "time": time.time(), "layout": list(layout), "rows": rows}


@pytest.fixture
def sidecar(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        yield sp


def _post(sp, path, body=None, content=None):
    return httpx.post(f"{sp.control_url}{path}", json=body, content=content, headers=sp.headers, timeout=30)


def _with_literal(body: dict, placeholder: str, literal: str) -> bytes:
    """The body as JSON with one value written as a literal json.dumps will not write (1e400)."""
    return json.dumps(body).replace(json.dumps(placeholder), literal).encode()


def _refused(r, field: str) -> None:
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"], r.text


def _still_serving(sp) -> None:
    t0 = time.monotonic()
    assert httpx.get(f"{sp.control_url}/healthz", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 2.0
    assert httpx.get(f"{sp.metrics_url}/metrics", timeout=10).status_code == 200
    assert "Traceback" not in sp.log(), sp.log()[-3000:]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_claimed_world_of_10_to_the_18_is_refused_and_the_leader_stays_small(sidecar):
    assert _post(sidecar, "/v1/activity", activity(0)).json()["ok"] is True  # the leader: it saw rank 0
    huge = 10**6
    _refused(_post(sidecar, "/v1/activity", activity(0, tp=huge, pp=huge, dp=huge, run_id="r2")), "activity.tp")
    _refused(  # each within bounds, their product not
        _post(sidecar, "/v1/activity", activity(0, tp=1000, pp=1000, dp=1, run_id="r2")),
        "activity [tp, pp, dp] [1000, 1000, 1] is a world of 1000000 ranks",
    )
    _refused(_post(sidecar, "/v1/digest", digest([row(1)], layout=(huge, huge, huge), run_id="r2")), "digest.layout")
    time.sleep(1.5)  # a hang tick or two over whatever was accepted
    _still_serving(sidecar)
    assert _rss_mb(sidecar.pid) < 300


def test_a_runs_layout_is_fixed_when_it_is_first_seen(sidecar):
    assert _post(sidecar, "/v1/activity", activity(0)).json()["ok"] is True
    _refused(_post(sidecar, "/v1/activity", activity(0, pp=4)), "fixed when it was first seen")
    _refused(_post(sidecar, "/v1/digest", digest([row(1)], layout=(1, 4, 1))), "fixed when it was first seen")
    assert _post(sidecar, "/v1/digest", digest([row(1)])).json()["ok"] is True
    _still_serving(sidecar)


def test_every_digest_row_field_is_checked(sidecar):
    assert _post(sidecar, "/v1/activity", activity(0)).json()["ok"] is True
    cases = [  # (a bad row, the field the 422 names)
        (row(time="soon"), "digest.rows[0].time"),
        (row(step=10**400), "digest.rows[0].step"),
        (row(pid=-5), "digest.rows[0].pid"),
        (row(state="exploded"), "digest.rows[0].state"),
        (row(host="x" * 10_000), "digest.rows[0].host"),
        (row(stage=0), "rank 1 says tp_rank 0, stage 0, dp_rank 0, but order"),  # rank 1 claiming stage 0's place
        (row(rank=7, stage=7), "digest.rows[0].rank"),
        (row()[:-3], "digest.rows[0]: Expected `array` of at least length 17, got 14"),
    ]
    for bad, field in cases:
        _refused(_post(sidecar, "/v1/digest", digest([bad])), field)
    _refused(
        _post(sidecar, "/v1/digest", content=_with_literal(digest([row(time="@")]), "@", "1e400")),
        "digest.rows[0].time",
    )
    _refused(_post(sidecar, "/v1/digest", digest([row(1), row(1)])), "appears twice")
    _refused(_post(sidecar, "/v1/digest", digest([row(1), row(0, host="node-b"), row(1)])), "digest.rows")
    time.sleep(1.5)
    _still_serving(sidecar)


def test_nodes_are_bounded_by_the_runs_world(sidecar):
    assert _post(sidecar, "/v1/activity", activity(0)).json()["ok"] is True
    for n in range(2):  # a world of 2 ranks has at most 2 nodes
        assert _post(sidecar, "/v1/digest", digest([row(n)], node=f"node-{n}")).json()["ok"] is True
    _refused(_post(sidecar, "/v1/digest", digest([], node="node-2")), "as many as its ranks")
    _still_serving(sidecar)


def test_activity_numbers_out_of_range_are_422_never_500(sidecar):
    for field, literal in (
        ("step", "1e400"),
        ("time", "1e400"),
        ("rank", "1" + "0" * 400),
        ("since", '"yesterday"'),
        ("seq", "-1"),
        ("kind", json.dumps("k" * 65)),
        ("pid", "true"),
    ):
        body = activity(0)
        body["activity"][field] = "@"
        r = _post(sidecar, "/v1/activity", content=_with_literal(body, "@", literal))
        _refused(r, f"activity.{field}")
    _refused(_post(sidecar, "/v1/activity", content=b"{not json"), "not valid JSON")
    _still_serving(sidecar)


def test_a_step_far_ahead_of_the_run_is_refused(sidecar):
    """Issue 25 item 3: on 8fae0f2 one activity claiming step 10^9 was taken, every real rank then looked
    stalled behind it, and with --hang-abort the run was killed. Steps move only as a run can move them."""
    assert _post(sidecar, "/v1/activity", activity(0, step=12)).status_code == 200
    _refused(_post(sidecar, "/v1/activity", activity(1, step=10**9)), "activity.step=1000000000 is ahead of the run")
    _refused(_post(sidecar, "/v1/digest", digest([row(1, step=10**9)])), "digest.rows[0].step=1000000000")
    assert _post(sidecar, "/v1/activity", activity(1, step=13)).status_code == 200  # the next step is fine
    assert _post(sidecar, "/v1/activity", activity(0, step=2)).status_code == 200  # a rollback goes back freely
    _still_serving(sidecar)


def test_a_digest_row_ahead_of_the_run_is_refused_alone(sidecar):
    """Refused whole, one row ahead of the run blinded the leader to the digest's every other rank."""
    assert _post(sidecar, "/v1/activity", activity(0, pp=3, step=12)).status_code == 200
    r = _post(sidecar, "/v1/digest", digest([row(1, step=13), row(2, step=10**9)], layout=(1, 3, 1)))
    assert r.status_code == 200, r.text
    [refused] = r.json()["refused"]
    assert refused["index"] == 1 and refused["reason"].startswith("digest.rows[1].step=1000000000 is ahead of the run")
    status = httpx.get(f"{sidecar.control_url}/v1/status", headers=sidecar.headers).json()
    [counted] = [x for x in status["refused"] if x["post"] == "digest"]
    assert counted["count"] == 1 and "1 of 2 rows, the rest taken" in counted["detail"]
    _still_serving(sidecar)


def test_a_rank_is_reported_by_one_node(sidecar):
    """Issue 25 item 3: on 8fae0f2 a digest row from any node saying a rank was `gone` was taken, and hang
    detection for the run stopped. A rank's rows come from the node that reports it while that node is heard."""
    assert _post(sidecar, "/v1/digest", digest([row(1)], node="node-b:9401")).status_code == 200
    _refused(
        _post(sidecar, "/v1/digest", digest([row(1, state="gone")], node="node-c:9401")),
        "rank 1 is reported by node 'node-b:9401', not 'node-c:9401'",
    )
    assert _post(sidecar, "/v1/digest", digest([row(1, state="gone")], node="node-b:9401")).status_code == 200
    _still_serving(sidecar)
