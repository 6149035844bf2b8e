"""A rank's instance records against a real sidecar (issue 25, item 8): on 8fae0f2 the model allowed 64 groups
of 100,000 members whatever the run's world, and the store kept every rank's newest summary whole, instance
records included (20 ranks x 3.9 MB summaries kept +23.7 MB per rank). Groups are checked against the run's
world, and the store keeps summaries without their records (the transfer tracker takes them once)."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
RANKS = 20  # tp 1 x pp 2 x dp 10
RECORDS = 20_000  # the most a summary may carry


def _summary(rank: int, step: int, **instances) -> dict:
    s = syn.summary(rank, step, pp=2, dp=RANKS // 2)
    s["instances"].update(instances)
    return s


def _post(sp, summaries) -> httpx.Response:
    return httpx.post(
        f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=sp.headers, timeout=60
    )


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_group_larger_than_the_world_is_refused(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        assert _post(sp, [_summary(0, 1)]).status_code == 200
        r = _post(sp, [_summary(1, 1, groups={"tp": list(range(100_000))})])
        assert r.status_code == 422 and "instances.groups.tp" in r.json()["detail"], r.text
        r = _post(sp, [_summary(1, 1, groups={"dp": [1, RANKS]})])
        assert r.status_code == 422 and f"world of {RANKS} ranks" in r.json()["detail"], r.text


def test_the_store_does_not_keep_every_ranks_records(tmp_path):
    records = [["all_reduce", "dp", i, -1, 0, 100, 1024] for i in range(RECORDS)]
    with running_sidecar(tmp_path / "state") as sp:
        assert _post(sp, [_summary(0, 1)]).status_code == 200
        before = _rss_mb(sp.pid)
        for rank in range(RANKS):
            r = _post(sp, [_summary(rank, 2, records=records)])
            assert r.status_code == 200, r.text
        grown = _rss_mb(sp.pid) - before
    assert grown < 40, f"RSS grew {grown:.0f} MB for {RANKS} ranks' summaries of {RECORDS} records"
