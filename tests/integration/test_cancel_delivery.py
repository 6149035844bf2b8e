"""Issue 24, item 2, against a real `parwatch sidecar`: a directive is created, then delivered (in a
reply to the run's ingest), then handled; `cancel` succeeds only before delivery and otherwise
answers 409 with the directive's state.

On 40e8301 `parwatch cancel` answered 200 "cancelled" while all 4 ranks applied the rollback, in 7
of 8 tries: the engine withdrew a directive already handed to rank 0, and the leader then wrote
an `applied` record with action null.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]


def _ingest(sp, client, step: int | None) -> dict:
    summaries = (
        []
        if step is None
        else [syn.summary(r, step, global_stages=STAGES if r == 0 else None, checkpoints=[1]) for r in (0, 1)]
    )
    r = client.post(f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=sp.headers)
    assert r.status_code == 200, r.text
    return r.json()


def _pause(sp, client) -> int:
    r = client.post(f"{sp.control_url}/v1/control", json={"action": "pause", "reason": "race"}, headers=sp.headers)
    assert r.status_code == 200, r.text
    return r.json()["directive_id"]


def _cancel(sp, client, did: int) -> httpx.Response:
    return client.post(
        f"{sp.control_url}/v1/directives/{did}/cancel", json={"requested_by": "test"}, headers=sp.headers
    )


def _handled(sp, client, did: int) -> None:
    r = client.post(
        f"{sp.control_url}/v1/ingest",
        headers=sp.headers,
        json={"version": 1, "summaries": [], "outcomes": [syn.outcome(did)]},
    )
    assert r.status_code == 200, r.text


def test_cancel_before_delivery_succeeds_and_after_it_is_a_409_with_the_state(tmp_path):
    with running_sidecar(tmp_path / "state") as sp, httpx.Client(timeout=30) as client:
        _ingest(sp, client, 1)
        did = _pause(sp, client)
        status = client.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()
        assert {"id": did, "action": "pause", "state": "created", "delivered_at": None} in status["directives"]
        assert _cancel(sp, client, did).status_code == 200
        did = _pause(sp, client)
        assert _ingest(sp, client, None)["directive"]["id"] == did  # rank 0's poll: delivered
        r = _cancel(sp, client, did)
        assert r.status_code == 409, r.text
        assert r.json()["directive"]["state"] == "delivered" and "can no longer be cancelled" in r.json()["detail"]
        status = client.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()
        assert [d["state"] for d in status["directives"]] == ["delivered"]


def test_cancel_raced_against_delivery_always_answers_true(tmp_path):
    """20 races of a cancel against rank 0's poll: 200 exactly when the poll did not carry it."""
    outcomes = []
    with (
        running_sidecar(tmp_path / "state") as sp,
        httpx.Client(timeout=30) as client,
        httpx.Client(timeout=30) as poller,
    ):
        _ingest(sp, client, 1)
        for i in range(20):
            did = _pause(sp, client)
            got: dict = {}
            start = threading.Barrier(2)

            lag = random.Random(i).uniform(-0.004, 0.004)  # either side may go first

            def poll(start=start, lag=lag, got=got):
                start.wait()
                time.sleep(max(lag, 0.0))
                got["reply"] = _ingest(sp, poller, None)

            t = threading.Thread(target=poll)
            t.start()
            start.wait()
            time.sleep(max(-lag, 0.0))
            answer = _cancel(sp, client, did)
            t.join(30)
            delivered = (got["reply"].get("directive") or {}).get("id") == did
            assert answer.status_code == (409 if delivered else 200), (i, answer.text, got)
            outcomes.append(answer.status_code)
            if delivered:  # the run applies it (rank 0 reports it), then a resume, delivered and applied
                _handled(sp, client, did)
                resume = client.post(
                    f"{sp.control_url}/v1/control", headers=sp.headers, json={"action": "resume", "reason": "race"}
                ).json()["directive_id"]
                assert _ingest(sp, client, None)["directive"]["id"] == resume
                _handled(sp, client, resume)
        decisions = client.get(f"{sp.control_url}/v1/decisions", headers=sp.headers).json()
    assert all(d.get("action") is not None for d in decisions if d.get("type") != "decision"), decisions
    print(f"\n20 races: {outcomes.count(200)} cancelled before delivery, {outcomes.count(409)} refused after")
