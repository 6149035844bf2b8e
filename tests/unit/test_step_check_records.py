"""The check before the optimizer step, at the sidecar: rank 0's check records recorded once each, after
the post's summaries; the suspect-device rule and metric; a pause held; a skip as a change under a rule
that still fires; parwatch_loss the newest step's; the shipper keeps a record the sidecar may take later."""

from __future__ import annotations

import json
import math
import time

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from parwatch.collector.shipper import Shipper
from parwatch.collector.wire import check_record
from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn
from tests.unit.test_engine_escalation import Steps

RUN = "run-checks"
STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.3)]


def verdict(step: int, action: str = "rerun", triage: str = "transient", ranks=(1,), applied=True) -> dict:
    """Event.STEP_CHECKED's verdict, as StepCheck makes it."""
    evidence = {"first": {"loss": 2.0, "grad_sq_sum": "nan", "nonfinite_grads": list(ranks)}}
    if action != "rerun":
        evidence |= {"rerun": {"loss": "nan", "nonfinite_loss": list(ranks)}, "skipped_steps": [step]}
    if action == "pause":
        evidence["pause"] = "3 steps skipped within 500 steps (pause_after_skips=3)"
    return {
        "step": step,
        "applied": applied,
        "action": action,
        "fault": "step-nonfinite",
        "triage": triage,
        "ranks": list(ranks),
        "loss": 2.0 if applied else "nan",
        "batch": step,
        "evidence": evidence,
    }


def body(step: int, *checks: dict, run_id: str = RUN, loss: float = 2.0) -> dict:
    summaries = [
        syn.summary(r, step, run_id=run_id, time=float(step), global_stages=STAGES if r == 0 else None, loss=loss)
        for r in range(2)
    ]
    records = [json.loads(json.dumps(_record(c, run_id))) for c in checks]
    return {"version": 1, "summaries": summaries, "checks": records}


def _record(check: dict, run_id: str) -> dict:
    import msgspec

    return msgspec.to_builtins(check_record(check, run_id, 0, 1_000_000.0))


class Side:
    def __init__(self, tmp_path):
        self.sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / "state"))
        auth = {"Authorization": f"Bearer {self.sidecar.config.token}"}
        self.control = TestClient(create_control_app(self.sidecar), headers=auth)
        self.metrics = TestClient(create_metrics_app(self.sidecar))

    def post(self, payload: dict, status: int = 200):
        r = self.control.post("/v1/ingest", json=payload)
        assert r.status_code == status, r.text
        return r

    def checks(self) -> list[dict]:
        return [d for d in self.sidecar.engine.decisions(100) if d.get("source") == "step_check"]

    def sample(self, name: str, **labels) -> float | None:
        for family in text_string_to_metric_families(self.metrics.get("/metrics").text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None


def test_a_check_of_a_runs_first_step_is_recorded_after_the_summary_that_begins_the_run(tmp_path):
    side = Side(tmp_path)
    side.post(body(1, verdict(1)))
    (recorded,) = side.checks()
    assert (recorded["rule"], recorded["action"], recorded["triage"], recorded["ranks"], recorded["batch"]) == (
        "step-nonfinite",
        "rerun",
        "transient",
        [1],
        1,
    )
    assert recorded["enforced"] and recorded["run_id"] == RUN and "step 1 (batch 1) was transient" in recorded["reason"]
    side.post(body(2, verdict(1)))  # resent (its post's answer was lost): recorded once
    assert len(side.checks()) == 1


def test_a_check_of_a_run_that_has_not_begun_is_refused_so_rank_0_sends_it_again(tmp_path):
    side = Side(tmp_path)
    side.post(body(1))
    late = {"version": 1, "summaries": [], "checks": [_record(verdict(3), "another-run")]}
    assert "has not begun here" in side.post(late, status=409).json()["detail"]
    assert side.checks() == []


def test_two_transients_on_one_rank_make_it_a_suspect_named_by_the_rule_and_the_metric(tmp_path):
    side = Side(tmp_path)
    side.post(body(1, verdict(1, ranks=(1,))))
    side.post(body(2))
    assert [d for d in side.sidecar.engine.decisions(100) if d.get("rule") == "suspect-device"] == []
    side.post(body(3, verdict(3, ranks=(1,))))  # judged as it arrives: a run's last step may come before it
    (suspect,) = [d for d in side.sidecar.engine.decisions(100) if d.get("rule") == "suspect-device"]
    assert suspect["action"] == "alert" and suspect["evidence"]["culprit"] == {"rank": 1}, suspect
    assert side.sample("parwatch_rank_transient_faults_total", rank="1") == 2.0
    assert side.sample("parwatch_rank_transient_faults_total", rank="0") is None  # only ranks with one


def test_a_pause_decided_by_the_ranks_holds_the_run_at_the_leader_until_a_resume(tmp_path):
    side = Side(tmp_path)
    side.post(body(1))
    side.post(body(2, verdict(2, "pause", "persistent", applied=False)))
    (paused,) = side.checks()
    assert paused["action"] == "pause" and paused["escalated"] and "pause_after_skips=3" in paused["reason"]
    assert side.sidecar.engine.paused and side.sample("parwatch_run_paused") == 1.0


def test_parwatch_loss_is_the_newest_steps_not_the_views_step_before(tmp_path):
    side = Side(tmp_path)
    payload = body(5, loss=1.25)
    payload["summaries"][0]["loss"] = 1.25  # every rank's summary carries the boundary's loss of its step
    payload["summaries"][0]["global"]["loss"] = 1.5  # the view: step 4's
    side.post(payload)
    assert side.sample("parwatch_train_step") == 5.0 and side.sample("parwatch_loss") == 1.25


def test_a_skip_is_a_change_under_a_rule_that_still_fires_it_acts_again(tmp_path):
    run = Steps(tmp_path)
    for s in range(1, 6):
        run.step(s, 2.0)
    (rollback,) = run.step(6, math.nan)
    assert rollback["action"] == "rollback"
    run.engine.record_check(_record(verdict(7, "skip", "persistent", applied=False), "run-42"))
    (again,) = run.step(8, math.nan)
    assert again["action"] == "pause" and "after the skip of step 7 before the weights" in again["reason"], again


class Refusing:
    """A sidecar that answers 409 (a run not begun there) twice, then takes everything."""

    def __init__(self) -> None:
        self.refusals, self.bodies = 2, []

    def post(self, url, content, headers):
        class Reply:
            status_code, text = (409, "not begun") if self.refusals else (200, "")

            def json(self):
                return {"accepted": 0, "directive": None}

        if self.refusals:
            self.refusals -= 1
        else:
            self.bodies.append(json.loads(content))
        return Reply()


def test_a_check_record_refused_for_now_is_sent_again():
    poster = Refusing()
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.1, poll_interval_s=60).start()
    try:
        shipper.put_check(check_record(verdict(4), RUN, 0, 1_000_000.0))
        deadline = time.monotonic() + 20
        while not any(b.get("checks") for b in poster.bodies):
            assert time.monotonic() < deadline, "the record was given up"
            time.sleep(0.02)
        assert poster.bodies[0]["checks"][0]["step"] == 4
    finally:
        shipper.close()
