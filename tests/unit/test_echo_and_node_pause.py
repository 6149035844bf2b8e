"""Issue 43, finding 13: a rank that died of a peer's loss is never the culprit of a later record (the echo rule),
and a node sidecar says paused while the leader says the run is paused."""

from __future__ import annotations

import asyncio

from msgspec.structs import replace

from parwatch.rank_layout import RankLayout
from parwatch.sidecar.hang import HangMonitor, HangSettings
from tests.unit.test_digest_api import _Bridge, _client, report
from tests.unit.test_hang_analysis import Clock, FakeEngine, act

PEER_LOST = "RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:12345"


def test_a_later_echo_is_never_named_the_culprit():
    """On d484f20 a second rank-gone record named rank 0 ("connection closed by peer") 9.3 s after the real
    crash of rank 1."""
    clock, engine = Clock(), FakeEngine()
    monitor, lay = HangMonitor(HangSettings(), engine, clock), RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    crashed = replace(act(1, lay, "backward", step=3, state="crashed"), error="ValueError: bad batch")
    [first] = monitor.check({0: act(0, lay, "recv", "recv", "pp", peer=1, step=3), 1: crashed})
    assert first["evidence"]["culprit"]["rank"] == 1
    echo = replace(act(0, lay, "recv", "recv", "pp", peer=1, step=3, state="crashed"), error=PEER_LOST)
    records = []
    for _ in range(20):  # 10 s of asks after the echo: past the 8 s an echo alone is waited on
        clock.t += 0.5
        records += monitor.check({0: echo, 1: crashed})
    [later] = records
    assert later["rule"] == "rank-gone" and later["evidence"]["culprit"] is None
    assert later["evidence"]["echo_of"] == 1 and "echoes of rank 1" in later["reason"]


def test_a_node_sidecar_says_paused_while_the_leader_holds_the_run_paused(tmp_path):
    """On d484f20 a node sidecar's status said paused=False during a pause (its engine judges nothing)."""
    from tests.fixtures import synthetic as syn

    leader, lsc, lclock = _client(tmp_path, "leader")
    node, nsc, nclock = _client(tmp_path, "node", leader_url="http://leader")
    nsc.activity._http = _Bridge(leader)
    assert (
        node.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(1, 1, run_id="r1")]}).status_code == 200
    )
    assert node.post("/v1/activity", json=report(1, step=1, time=nclock.t)).status_code == 200
    leader.post("/v1/activity", json=report(0, host="leader-host", time=lclock.t))
    lsc.engine.policy.run.paused = True  # the run is paused (as after a pause directive's outcome)
    asyncio.run(nsc.activity.tick())
    assert node.get("/v1/status").json()["paused"] is True
    lsc.engine.policy.run.paused = False
    asyncio.run(nsc.activity.tick())
    assert node.get("/v1/status").json()["paused"] is False
