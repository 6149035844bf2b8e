"""Directives end to end through the real engine: operator control, guardrail decisions from
ingested summaries, outcome records, and the Alertmanager webhook (dedupe, resolved)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn

STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]


def make(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / "state"))
    return sidecar, TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})


@pytest.fixture
def setup(tmp_path):
    return make(tmp_path)


def ingest_step(client, step, checkpoints=(), outcomes=(), global_loss=None) -> dict:
    """Both ranks of a 2-stage run report `step`; rank 0 carries the global view of step-1 and any outcomes."""
    r = client.post(
        "/v1/ingest",
        json={
            "version": 1,
            "outcomes": list(outcomes),
            "summaries": [
                syn.summary(0, step, checkpoints=checkpoints, global_stages=STAGES, global_loss=global_loss),
                syn.summary(1, step),
            ],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def decisions(client, limit=50):
    return [d for d in client.get("/v1/decisions", params={"limit": limit}).json() if d["type"] == "decision"]


def test_operator_pause_reaches_the_next_ingest_and_its_outcome_applies_it(setup):
    sidecar, client = setup
    assert ingest_step(client, 1)["directive"] is None
    r = client.post("/v1/control", json={"action": "pause", "reason": "look at the loss"})
    assert r.status_code == 200
    decision = r.json()
    assert decision["action"] == "pause" and decision["source"] == "operator" and decision["enforced"]
    directive = ingest_step(client, 2)["directive"]
    assert directive == {
        "id": decision["directive_id"],
        "action": "pause",
        "run_id": "synthetic",
        "to_step": None,
        "skip_batches": 0,
        "reason": "look at the loss",
    }
    assert client.get("/v1/status").json()["paused"] is False  # not applied yet
    after = ingest_step(client, 3, outcomes=[syn.outcome(directive["id"], step=2)])
    assert after["directive"] is None
    status = client.get("/v1/status").json()
    assert status["paused"] is True and status["pending_directive"] is None
    applied = [d for d in client.get("/v1/decisions").json() if d["type"] == "applied"]
    assert applied[-1]["directive_id"] == directive["id"] and applied[-1]["ranks"] == "0-1"
    # resume then goes the same way, in a poll while paused (no summaries)
    client.post("/v1/control", json={"action": "resume"})
    resume = ingest_step(client, 4)["directive"]
    assert resume["action"] == "resume"
    r = client.post("/v1/ingest", json={"version": 1, "summaries": [], "outcomes": [syn.outcome(resume["id"])]})
    assert r.status_code == 200 and r.json()["directive"] is None
    assert client.get("/v1/status").json()["paused"] is False


def test_an_outcome_of_another_run_is_not_acted_on(setup):
    sidecar, client = setup
    ingest_step(client, 1)
    directive_id = client.post("/v1/control", json={"action": "pause"}).json()["directive_id"]
    ingest_step(client, 2, outcomes=[syn.outcome(directive_id, run_id="another-run")])
    assert client.get("/v1/status").json()["pending_directive"]["id"] == directive_id


def test_cancel_withdraws_a_pending_directive(setup):
    sidecar, client = setup
    ingest_step(client, 1)
    directive_id = client.post("/v1/control", json={"action": "pause"}).json()["directive_id"]
    r = client.post(f"/v1/directives/{directive_id}/cancel", json={"requested_by": "operator:bob"})
    assert r.status_code == 200 and r.json()["type"] == "cancelled"
    assert ingest_step(client, 2)["directive"] is None
    again = client.post(f"/v1/directives/{directive_id}/cancel", json={})
    assert again.status_code == 404 and "not outstanding" in again.json()["detail"]


def test_a_new_run_starts_with_nothing_pending(setup):
    sidecar, client = setup
    ingest_step(client, 1)
    client.post("/v1/control", json={"action": "pause"})
    new_run = {"version": 1, "summaries": [syn.summary(0, 1, run_id="next-run", global_stages=STAGES)]}
    r = client.post("/v1/ingest", json=new_run)  # the first run is live: a stray summary cannot end it
    assert r.status_code == 409 and "is live here" in r.json()["detail"], r.text
    sidecar.store.ended = True  # its ranks said they finished (activity "done")
    r = client.post("/v1/ingest", json=new_run)
    assert r.json()["directive"] is None
    status = client.get("/v1/status").json()
    assert status["pending_directive"] is None and status["run"]["run_id"] == "next-run"


def test_rollback_needs_a_known_checkpoint(setup):
    sidecar, client = setup
    ingest_step(client, 1)
    r = client.post("/v1/control", json={"action": "rollback"})
    assert r.status_code == 400 and "checkpoint" in r.json()["detail"]
    ingest_step(client, 2, checkpoints=[1])
    r = client.post("/v1/control", json={"action": "rollback", "to_step": 1, "skip_batches": 3})
    assert r.status_code == 200
    assert ingest_step(client, 3)["directive"] | {"reason": ""} == {
        "id": r.json()["directive_id"],
        "action": "rollback",
        "run_id": "synthetic",
        "to_step": 1,
        "skip_batches": 3,
        "reason": "",
    }


@pytest.mark.parametrize(
    "payload, status, expected",
    [
        ({"action": "explode"}, 422, "action: Invalid enum value 'explode' (one of pause, resume, rollback)"),
        ({"action": "pause", "to_step": 3}, 400, "to_step and skip_batches apply to rollback only"),
        ({"action": "rollback", "skip_batches": -1}, 422, "skip_batches: Expected `int` >= 0"),
        ({"action": "pause", "colour": "red"}, 422, "colour: not a field of this body"),
        ({"action": "rollback", "to_step": 10**400}, 422, "to_step: Expected `int` <= 9007199254740991"),
    ],
)
def test_bad_control_requests_get_422_or_the_engines_400(setup, payload, status, expected):
    """422: the body fails validation (as the OpenAPI document says); 400: the engine refuses it."""
    _, client = setup
    r = client.post("/v1/control", json=payload)
    assert r.status_code == status
    assert expected in r.json()["detail"]


def test_nonfinite_loss_from_the_fast_path_triggers_a_rollback(setup):
    sidecar, client = setup
    for step in range(1, 5):
        ingest_step(client, step, checkpoints=[2])
    directive = ingest_step(client, 5, checkpoints=[2], global_loss=float("nan"))["directive"]
    assert directive["action"] == "rollback" and directive["to_step"] == 2
    last = decisions(client)[-1]
    assert last["rule"] == "nonfinite-loss" and last["step"] == 4
    status = client.get("/v1/status").json()  # NaN evidence must still be valid JSON
    assert status["rules"]["nonfinite-loss"]["state"] == "firing"


def test_engine_evaluates_once_per_new_global_step(setup):
    sidecar, client = setup
    calls = []
    real = sidecar.engine.evaluate
    sidecar.engine.evaluate = lambda obs: calls.append(obs.step) or real(obs)
    ingest_step(client, 1)
    ingest_step(client, 2)
    # rank 1 alone, and a retried rank 0 summary, do not evaluate again
    client.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(1, 3)]})
    client.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(0, 2, global_stages=STAGES)]})
    assert calls == [0, 1]


def alert(status="firing", action="pause", fingerprint="fp1", name="ParwatchBubbleExcess", **labels):
    return {
        "status": status,
        "fingerprint": fingerprint,
        "startsAt": "2026-01-01T00:00:00Z",
        "labels": {"alertname": name, "parwatch_action": action, **labels},
        "annotations": {"summary": "bubble above 0.1"},
    }


def webhook(*alerts, status="firing"):
    return {
        "version": "4",
        "status": status,
        "receiver": "parwatch",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://am",
        "alerts": list(alerts),
    }


def test_alert_acts_once_per_firing_fingerprint_until_resolved(setup):
    sidecar, client = setup
    ingest_step(client, 1)
    r = client.post("/v1/alerts", json=webhook(alert()))
    assert r.status_code == 200 and r.json() == {"acted": 1}
    d = decisions(client)[-1]
    assert d["source"] == "alertmanager" and d["action"] == "pause"
    assert d["reason"] == "ParwatchBubbleExcess: bubble above 0.1" and d["requested_by"] == "alertmanager:parwatch"
    assert client.get("/v1/status").json()["pending_directive"]["action"] == "pause"
    # repeat notifications of the same firing alert do nothing
    assert client.post("/v1/alerts", json=webhook(alert())).json() == {"acted": 0}
    assert len(decisions(client)) == 1
    # resolved clears it; firing again acts again
    client.post("/v1/alerts", json=webhook(alert(status="resolved"), status="resolved"))
    assert client.post("/v1/alerts", json=webhook(alert())).json() == {"acted": 1}
    assert len(decisions(client)) == 2


def test_alerts_without_a_directive_action_are_ignored(setup):
    _, client = setup
    payload = webhook(alert(action="alert", fingerprint="a"), alert(action="", fingerprint="b"))
    r = client.post("/v1/alerts", json=payload)
    assert r.json() == {"acted": 0} and decisions(client) == []


def test_alert_dedupe_survives_a_sidecar_restart(tmp_path):
    _, client = make(tmp_path)
    ingest_step(client, 1)
    client.post("/v1/alerts", json=webhook(alert()))
    _, again = make(tmp_path)
    assert again.post("/v1/alerts", json=webhook(alert())).json() == {"acted": 0}
    assert again.get("/v1/status").json()["pending_directive"]["action"] == "pause"


def test_alert_rollback_without_checkpoint_pauses_instead(setup):
    _, client = setup
    ingest_step(client, 1)
    assert client.post("/v1/alerts", json=webhook(alert(action="rollback"))).json() == {"acted": 1}
    d = decisions(client)[-1]
    assert d["action"] == "pause" and "rollback impossible" in d["reason"]


def test_alert_rollback_goes_to_the_newest_checkpoint(setup):
    _, client = setup
    ingest_step(client, 1, checkpoints=[1])
    ingest_step(client, 2, checkpoints=[1])
    client.post("/v1/alerts", json=webhook(alert(action="rollback", parwatch_skip_batches="4")))
    directive = client.get("/v1/status").json()["pending_directive"]
    assert directive["action"] == "rollback" and directive["to_step"] == 1 and directive["skip_batches"] == 4


def test_bad_alert_payloads_get_422(setup):
    _, client = setup
    r = client.post("/v1/alerts", json={"version": "3", "status": "firing", "alerts": []})
    assert r.status_code == 422 and r.json()["detail"].startswith("version")
    r = client.post("/v1/alerts", json=webhook({"status": "burning"}))
    assert r.status_code == 422 and "alerts.0.status" in r.json()["detail"]


def test_status_and_decisions_shape(setup):
    _, client = setup
    ingest_step(client, 1)
    client.post("/v1/control", json={"action": "pause"})
    status = client.get("/v1/status").json()
    assert status["run"]["run_id"] == "synthetic" and status["run"]["pp"] == 2
    assert status["last_step"] == 1 and set(status["ranks"]) == {"0", "1"}
    assert set(status["rules"]) >= {"nonfinite-loss", "bubble-excess", "rank-missing"}
    assert status["last_decisions"][-1]["action"] == "pause"
    assert len(client.get("/v1/decisions", params={"limit": 1}).json()) == 1
    assert client.get("/v1/decisions", params={"limit": 0}).status_code == 422
