"""A long operator pause must not read as dead ranks: rank 0's polls vouch for the run, but only
when a heartbeat collective (which every rank joins) completed since its last post."""

from __future__ import annotations

from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _ingest(client, summaries, alive=False):
    body = {"version": 1, "summaries": summaries}
    if alive:
        body["alive"] = True
    r = client.post("/v1/ingest", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_polls_while_paused_keep_every_rank_up_but_not_while_running(tmp_path):
    clock = Clock()
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path, rank_grace_seconds=30.0), clock=clock)
    client = TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})
    _ingest(client, [syn.summary(0, 1), syn.summary(1, 1)])
    client.post("/v1/control", json={"action": "pause"})
    directive = _ingest(client, [syn.summary(0, 2), syn.summary(1, 2)])["directive"]
    client.post("/v1/ingest", json={"version": 1, "summaries": [], "outcomes": [syn.outcome(directive["id"], step=2)]})
    assert sidecar.engine.paused
    for _ in range(10):  # five minutes of pause, rank 0 polling after heartbeats
        clock.t += 30.0
        _ingest(client, [], alive=True)
    assert sidecar.store.liveness() == {0: True, 1: True}
    clock.t += 31.0
    _ingest(client, [])  # a poll without a heartbeat behind it: the ranks may be stuck
    assert sidecar.store.liveness() == {0: False, 1: False}
    _ingest(client, [], alive=True)
    client.post("/v1/control", json={"action": "resume"})
    resume = _ingest(client, [])["directive"]
    client.post("/v1/ingest", json={"version": 1, "summaries": [], "outcomes": [syn.outcome(resume["id"], step=3)]})
    _ingest(client, [syn.summary(0, 4), syn.summary(1, 4)])
    assert not sidecar.engine.paused
    clock.t += 31.0
    _ingest(client, [], alive=True)  # running again: only summaries count
    assert sidecar.store.liveness() == {0: False, 1: False}
