"""Directive bookkeeping that a paused run depends on (found in review, kept by these tests)."""

from __future__ import annotations

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import parse_rules

RULES = "version: 1\nrules:\n  - name: skew\n    metric: pipeline_skew_ratio\n    above: 2.0\n    action: alert\n"


def _engine(tmp_path):
    engine = GuardrailEngine(parse_rules(RULES), tmp_path, now=lambda: 1000.0)
    engine.begin_run("r")
    engine.evaluate(Observation(step=1, time=1000.0, series={"pipeline_skew_ratio": {"": 1.0}}, checkpoints=(0,)))
    return engine


def _apply(engine, world=2, step=5):
    d = engine.pending_directive()
    engine.record_outcome(
        {
            "directive_id": d["id"],
            "run_id": "r",
            "outcome": "applied",
            "step": step,
            "loaded_step": d["to_step"],
            "counts": {"applied": world},
            "ranks": world,
        }
    )
    return d


def test_a_second_pause_while_paused_is_recorded_but_not_queued_ahead_of_resume(tmp_path):
    engine = _engine(tmp_path)
    engine.request("pause", "operator")
    _apply(engine)
    assert engine.paused
    second = engine.request("pause", "alertmanager")
    assert second["enforced"] is False and second["directive_id"] is None
    engine.request("resume", "operator")
    assert engine.pending_directive()["action"] == "resume"  # nothing queued ahead of it
    _apply(engine)
    assert not engine.paused


def test_a_pause_requested_while_one_is_pending_is_not_queued_twice(tmp_path):
    engine = _engine(tmp_path)
    first = engine.request("pause", "operator")
    second = engine.request("pause", "operator")
    assert first["enforced"] and not second["enforced"]


def test_a_rollback_applied_during_a_pause_ends_the_pause(tmp_path):
    engine = _engine(tmp_path)
    engine.request("pause", "operator")
    _apply(engine)
    engine.request("rollback", "operator", to_step=0)
    _apply(engine)
    assert not engine.paused


def test_a_sidecar_that_lost_its_state_still_issues_ids_newer_than_the_trainer_saw(tmp_path):
    old = GuardrailEngine(parse_rules(RULES), tmp_path / "old", now=lambda: 1000.0)
    old.begin_run("r")
    seen = old.request("pause", "operator")["directive_id"]
    fresh = GuardrailEngine(parse_rules(RULES), tmp_path / "new", now=lambda: 1001.0)
    fresh.begin_run("r")
    assert fresh.request("pause", "operator")["directive_id"] > seen
    again = GuardrailEngine(parse_rules(RULES), tmp_path / "old", now=lambda: 5.0)  # restart, state kept
    assert again.request("resume", "operator")["directive_id"] == seen + 1


def test_a_cancelled_rule_directive_lets_the_rule_act_again(tmp_path):
    """Issue 25, item 6: on 40e8301 a cancelled rule rollback left the rule firing, acted on, silent."""
    rules = RULES + "    cooldown_steps: 5\n"
    engine = GuardrailEngine(parse_rules(rules.replace("action: alert", "action: pause")), tmp_path, now=lambda: 1000.0)
    engine.begin_run("r")
    bad = {"pipeline_skew_ratio": {"": 3.0}}
    for step in (1, 2, 3):
        engine.evaluate(Observation(step=step, time=1000.0, series=bad, checkpoints=(0,)))
    [made] = [d for d in engine.decisions() if d.get("rule") == "skew"]
    cancelled = engine.cancel(made["directive_id"], "operator")
    assert cancelled["rearmed_rules"] == ["skew"]
    for step in (4, 5):
        engine.evaluate(Observation(step=step, time=1000.0, series=bad, checkpoints=(0,)))
    again = [d for d in engine.decisions() if d.get("rule") == "skew"]
    assert len(again) == 2 and again[1]["enforced"] and again[1]["directive_id"] is not None, again


def test_every_record_the_engine_logs_is_its_typed_log_record(tmp_path):
    """Decisions (a rule's, an operator's, Alertmanager's, the engine's escalation), a cancel and outcomes:
    each line of decisions.jsonl and each record the API returns decodes as parwatch.wire.log says, and a
    field of the wrong type is named."""
    import json

    import pytest

    from parwatch.wire.codec import BadRecord
    from parwatch.wire.log import check_log_record

    engine = GuardrailEngine(parse_rules(RULES.replace("action: alert", "action: pause")), tmp_path, now=lambda: 1000.0)
    engine.begin_run("r")
    engine.evaluate(Observation(step=1, time=1000.0, series={"pipeline_skew_ratio": {"": 3.0}}, checkpoints=(0,)))
    _apply(engine)  # the rule's pause
    engine.request("resume", "operator", requested_by="alice")
    _apply(engine)
    mirrored = engine.request("pause", "alertmanager", rule="skew")  # the rule acted: logged, not enforced
    assert mirrored["alert_rule"] == "skew" and not mirrored["enforced"]
    engine.cancel(engine.request("pause", "operator")["directive_id"], requested_by="alice")
    engine.request("rollback", "operator", to_step=0)
    d = engine.pending_directive()
    engine.record_outcome(  # a failed rollback: the engine escalates to a pause and an alert
        {"directive_id": d["id"], "run_id": "r", "outcome": "failed", "step": 5, "counts": {"failed": 2}, "ranks": 2}
    )
    unknown = {"directive_id": 99, "run_id": "r", "outcome": "applied", "step": 6, "counts": {"applied": 2}, "ranks": 2}
    [orphan] = engine.record_outcome(unknown)  # a directive this engine never made: its action is unknown
    assert orphan["action"] is None and orphan["note"]
    engine.close()
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    kinds = [(r["type"], r.get("source")) for r in lines]
    assert ("decision", "rule") in kinds and ("decision", "engine") in kinds and ("cancelled", None) in kinds
    assert ("applied", None) in kinds and ("failed", None) in kinds
    for record in lines + engine.decisions(100):
        check_log_record(record)
    with pytest.raises(BadRecord, match=r"decision.step: Expected `int \| null`, got `str`"):
        check_log_record({**lines[0], "step": "five"})
    with pytest.raises(BadRecord, match="unknown record type 'verdict'"):
        check_log_record({**lines[0], "type": "verdict"})
