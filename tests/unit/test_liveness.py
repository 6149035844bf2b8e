"""rank_up judged where it is known (issue 24, item 5): activity first, over the whole world at the
leader. A rank that waits on a peer (or is paused) is alive, whatever its summaries; one whose node
went quiet is not; rank-missing never names a waiting rank."""

from __future__ import annotations

import asyncio
import os
import socket

from test_digest_api import _client, report

from parwatch.wire.activity import ROW_FIELDS
from tests.fixtures import synthetic as syn

HOST = socket.gethostname()


def _activity(rank, step, t, **kw):
    # dp 2 x pp 2: ranks 0 and 1 on this node (stage 0 and 1 of replica 0), ranks 2 and 3 on node-b
    return report(
        rank,
        step=step,
        host=HOST,
        pid=os.getpid(),
        stage=rank % 2,
        dp_rank=rank // 2,
        dp=2,
        kind="collective",
        op="all_reduce",
        group="dp",
        seq=7,
        time=t,
        **kw,
    )


def _digest(t, state="running"):
    rows = []
    for rank in (2, 3):
        a = _activity(rank, 5, t)["activity"]
        a["state"] = state
        rows.append([a.get(f) for f in ROW_FIELDS])
    return {"version": 1, "node": "node-b:9401", "run_id": "r1", "time": t, "layout": [1, 2, 2], "rows": rows}


def test_waiting_ranks_stay_up_at_the_leader_and_a_quiet_node_goes_down(tmp_path):
    client, sidecar, clock = _client(tmp_path, "leader", rank_grace_seconds=5.0)
    for step in (1, 2, 3, 4, 5):  # summaries, then nothing: every rank blocks in the DP all-reduce
        clock.t += 1
        r = client.post(
            "/v1/ingest",
            json={
                "version": 1,
                "summaries": [
                    syn.summary(
                        0,
                        step,
                        run_id="r1",
                        dp=2,
                        time=clock.t,
                        global_stages=[syn.stage_view(0, 0.5, 0.4), syn.stage_view(1, 0.5, 0.4)],
                    ),
                    syn.summary(1, step, run_id="r1", dp=2, time=clock.t),
                ],
            },
        )
        assert r.status_code == 200, r.text
    hub = sidecar.activity
    for _ in range(90):  # 18 grace periods without a summary; activity and digests every second
        clock.t += 1
        for rank in (0, 1):
            assert client.post("/v1/activity", json=_activity(rank, 5, clock.t)).status_code == 200
        assert client.post("/v1/digest", json=_digest(clock.t)).status_code == 200
        asyncio.run(hub.tick())
        assert sidecar.store.liveness() == {0: True, 1: True, 2: True, 3: True}
    assert not [d for d in sidecar.engine.decisions(100) if d.get("rule") == "rank-missing"]
    assert all(r["up"] for r in sidecar.status()["ranks"].values())

    # node-b's sidecar goes quiet: its ranks read unknown, hence down; the leader's own stay up
    for _ in range(10):
        clock.t += 1
        for rank in (0, 1):
            client.post("/v1/activity", json=_activity(rank, 5, clock.t))
        asyncio.run(hub.tick())
    assert sidecar.store.liveness() == {0: True, 1: True, 2: False, 3: False}
    # a digest that says its ranks' reporters went silent: down too
    client.post("/v1/digest", json=_digest(clock.t, state="silent"))
    asyncio.run(hub.tick())
    assert sidecar.store.liveness() == {0: True, 1: True, 2: False, 3: False}
