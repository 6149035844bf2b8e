"""Issue 43, findings 3, 4, 5 and 10, against real sidecars: one activity report cannot fake a hang, one stray
report cannot make a node sidecar the leader, another run's digests cannot replace the run's picture, and a
restarted leader neither names a hang on a paused run nor alerts on its own downtime."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from parwatch.credentials import node_credential
from tests import one_client
from tests.integration.e2e_util import wait_until
from tests.integration.trust_util import Elsewhere, decisions, ingest, post, rank_headers, summary
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
RUN = "r1"


def activity(rank: int, step: int, run_id: str = RUN, **kw) -> dict:
    now = time.time()
    a = {
        "run_id": run_id,
        "rank": rank,
        "pid": 10_000 + rank,
        "host": "elsewhere",
        "stage": rank,
        "tp_rank": 0,
        "dp_rank": 0,
        "tp": 1,
        "pp": 2,
        "dp": 1,
        "step": step,
        "step_seconds": 0.2,
        "kind": "forward",
        "since": now - 0.05,
        "time": now,
        "step_end": now - 0.1,
    }
    a.update(kw)
    return {"version": 1, "activity": a}


def hang_status(sp) -> dict:
    return one_client.get(f"{sp.control_url}/v1/hang", headers=sp.headers, timeout=10).json()


def test_one_forged_activity_report_fakes_no_hang_and_aborts_nothing(tmp_path):
    """Finding 3: one report with step + 500 and step_end far in the future froze the stall clock: a hang 9.75 s
    later, and with --hang-abort every rank told to exit 75. (+100 here: within d484f20's 1,000 steps a second.)"""
    elsewhere = Elsewhere()
    args = ("--hang-min-seconds", "2", "--hang-step-factor", "1", "--hang-abort")
    try:
        with running_sidecar(tmp_path / "state", *args) as sp, httpx.Client(timeout=10) as client:

            def steady(step: int) -> list[dict]:  # the real ranks at a step every ~0.2 s, bound 2 s
                time.sleep(0.2)
                url = f"{sp.control_url}/v1/activity"
                return [client.post(url, json=activity(r, step), headers=sp.headers).json() for r in (0, 1)]

            replies, step = [], 0
            for step in range(1, 6):
                replies += steady(step)
            for headers in (sp.headers, rank_headers(sp, RUN, 1)):
                forged = activity(1, step + 100, step_end=time.time() + 1000)
                status, text = elsewhere.post(sp, "/v1/activity", forged, headers)
                assert status == 422, (status, text)
            until = time.monotonic() + 6  # three bounds of steady steps
            while time.monotonic() < until:
                step += 1
                replies += steady(step)
            assert not any("abort" in r for r in replies), replies[-3:]
            assert hang_status(sp)["hang"] is None and not decisions(sp, "hang")
    finally:
        elsewhere.close()


def _forwarding(node, leader, rank: int) -> bool:
    """The leader sees `rank` running through the node's digests (a node that stopped forwarding goes stale)."""
    post(node, "/v1/activity", activity(rank, 3))
    post(leader, "/v1/activity", activity(0, 3))
    return hang_status(leader)["rank_states"].get("running") == 2


def test_a_stray_rank_0_report_leaves_a_node_a_node_and_another_runs_digest_is_refused(tmp_path):
    """Findings 4 and 10: one rank-0 activity report at a node sidecar (another job's rank 0, or any token
    holder) made it a "leader" for good: it stopped forwarding and the real leader lost that node. A digest or
    activity of another run id replaced the leader's picture (45,000 rank_state series) and re-armed its hang
    monitor on every switch."""
    with running_sidecar(tmp_path / "leader", token="tok") as leader:
        with running_sidecar(tmp_path / "node", "--leader-url", leader.control_url, token="tok") as node:
            wait_until(lambda: _forwarding(node, leader, 1), "the node's digests at the leader", timeout=20)
            stray = activity(0, 1, run_id="another-job")
            r = post(node, "/v1/activity", stray)
            assert r.status_code == 409 and "is live here" in r.json()["detail"], r.text
            assert post(node, "/v1/activity", activity(0, 3)).status_code == 200  # rank 0 of this run, misrouted
            assert hang_status(node)["leader"] is False
            deadline = time.monotonic() + 3  # the node keeps forwarding: the leader's picture stays fresh
            while time.monotonic() < deadline:
                assert wait_until(lambda: _forwarding(node, leader, 1), "the node still forwarding", timeout=5)
                time.sleep(0.5)
            # Another run's digest, with the shared token and with a node's own credential: refused while r1 lives.
            rows = [[5, "running", "forward", None, None, None, None, None, 1, 0.2, 1, "h", 0, 0, 5, time.time(), None]]
            digest = {"version": 1, "node": "n9", "run_id": "another-job", "time": time.time(), "layout": [1, 1, 9]}
            for headers in (leader.headers, {"Authorization": f"Bearer {node_credential('tok', 'n9')}"}):
                r = post(leader, "/v1/digest", {**digest, "rows": rows}, headers)
                assert r.status_code == 409, r.text
            wrong_node = {"Authorization": f"Bearer {node_credential('tok', 'n8')}"}
            assert post(leader, "/v1/digest", {**digest, "run_id": RUN, "rows": []}, wrong_node).status_code == 403
            assert hang_status(leader)["rank_states"] == {"running": 2}


def test_a_restarted_leader_names_no_hang_on_a_paused_run_and_no_silence_for_its_downtime(tmp_path):
    """Finding 5: after a leader outage the restarted leader named a false hang on the run rank 0 had paused
    (119 s "without a boundary") and fired no-data alerts for its own downtime."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        json.dumps(
            {
                "version": 1,
                "defaults": {"no_data_seconds": 2},
                "rules": [{"name": "nonfinite-loss", "metric": "loss", "check": "finite", "action": "alert"}],
            }
        )
    )
    state = tmp_path / "state"
    args = ("--rules", str(rules), "--hang-min-seconds", "1", "--hang-step-factor", "1")
    with running_sidecar(state, *args) as sp:
        for step in range(1, 6):
            for rank in (0, 1):
                assert ingest(sp, summary(rank, step, RUN, real=False)).status_code == 200
                post(sp, "/v1/activity", activity(rank, step))
        sp.proc.kill()  # the leader is lost; meanwhile rank 0 pauses the run itself
        sp.proc.wait()
    time.sleep(3)  # the outage: longer than no_data_seconds
    with running_sidecar(state, *args) as sp:
        restarted = time.time()
        until = time.monotonic() + 8  # past the restart's grace period and several hang bounds
        while time.monotonic() < until:
            assert ingest(sp, alive=True).status_code == 200  # rank 0's poll: its ranks beat paused heartbeats
            for rank in (0, 1):
                post(sp, "/v1/activity", activity(rank, 5, kind="boundary", step_end=restarted - 5))
            time.sleep(0.3)
        made = [d for d in decisions(sp) if d["time"] >= restarted]
        assert not made, [d["reason"] for d in made]
