"""What a sidecar says about the run's leader and about posts it refused (issue 24, item 4):
a node whose digests fail, are refused or go nowhere says so; a refused post is counted and logged."""

from __future__ import annotations

import logging

from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import Listen, SidecarConfig
from parwatch.sidecar.leader_link import ORPHAN_GRACE_SECONDS, LeaderLink, LeaderLinkMetrics
from parwatch.sidecar.refusals import Refusals
from parwatch.sidecar.service import build_sidecar


class Clock:
    def __init__(self, t=1_000.0):
        self.t = t

    def __call__(self):
        return self.t


def _gauge(link, leader=False):
    (family,) = LeaderLinkMetrics(lambda: link.status(leader)).collect()
    return family.samples[0].value


def test_a_node_says_since_when_its_leader_is_unreachable_and_when_it_is_back():
    clock = Clock()
    link = LeaderLink("http://leader:9401", clock)
    assert link.status(False)["reachable"] and _gauge(link) == 0.0
    link.failed("ConnectError: refused")
    clock.t += 5
    link.failed("HTTP 401: wrong bearer token")  # the start of the outage stays; the newest error is told
    st = link.status(False)
    assert (st["reachable"], st["unreachable_since"], st["error"]) == (False, 1_000.0, "HTTP 401: wrong bearer token")
    assert _gauge(link) == 1_000.0
    link.ok()
    assert link.status(False)["reachable"] and _gauge(link) == 0.0
    assert _gauge(link, leader=True) == 0.0 and link.status(True)["role"] == "leader"


def test_a_sidecar_without_leader_url_warns_when_its_ranks_belong_to_a_larger_run(caplog):
    clock = Clock()
    link = LeaderLink(None, clock)
    link.check_orphan([0, 1, 2, 3], 4)  # a one-node run: all of it reports here
    assert link.status(False) is None and not list(LeaderLinkMetrics(lambda: link.status(False)).collect())
    link.check_orphan([2, 3], 4)
    assert link.status(False) is None  # rank 0 may report here within a second: not yet
    clock.t += ORPHAN_GRACE_SECONDS
    with caplog.at_level(logging.ERROR):
        link.check_orphan([2, 3], 4)
    st = link.status(False)
    assert st["unreachable_since"] == 1_000.0 and "[2, 3]" in st["error"] and "--leader-url" in st["error"]
    assert "4-rank run" in caplog.text


def test_refusals_are_counted_by_post_and_reason_and_logged_once_a_minute(caplog):
    clock = Clock()
    refusals = Refusals(clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            refusals.note("/v1/digest", 401, "wrong bearer token")
        refusals.note("/v1/other", 401, "not a hot post")
    assert caplog.text.count("refused node sidecars' digests") == 1
    (family,) = refusals.collect()
    assert [(s.labels, s.value) for s in family.samples] == [({"post": "digest", "reason": "unauthorized"}, 3.0)]
    clock.t += 61
    with caplog.at_level(logging.WARNING):
        refusals.note("/v1/digest", 401, "wrong bearer token")
    assert "3 since the last such line" in caplog.text  # the three after the first line, and this one
    assert refusals.status() == [
        {"post": "digest", "reason": "unauthorized", "count": 4, "last_time": 1_061.0, "detail": "wrong bearer token"}
    ]


def test_the_control_app_counts_hot_posts_it_refuses(tmp_path):
    config = SidecarConfig(
        state_dir=tmp_path / "s",
        token="tok",
        control_listen=Listen("127.0.0.1", 9401),
        metrics_listen=Listen("127.0.0.1", 9400),
    )
    sidecar = build_sidecar(config, clock=Clock())
    client = TestClient(create_control_app(sidecar))
    assert (
        client.post(
            "/v1/ingest", json={"version": 1, "summaries": []}, headers={"Authorization": "Bearer nope"}
        ).status_code
        == 401
    )
    assert client.post("/v1/digest", json={"version": 9}, headers={"Authorization": "Bearer tok"}).status_code == 422
    assert sidecar.refusals.counts == {("ingest", "unauthorized"): 1, ("digest", "invalid"): 1}
    assert [r["post"] for r in sidecar.status()["refused"]] == ["digest", "ingest"]
