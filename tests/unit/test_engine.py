"""The guardrail engine: state transitions, actions, rollbacks, directives, persistence."""

import json
import math

import pytest

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import Rule, RuleSet


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def ruleset(*rules, **kw):
    return RuleSet(rules=rules, **kw)


def skew_rule(**kw):
    return Rule(
        **{
            "name": "skew",
            "metric": "pipeline_skew_ratio",
            "above": 1.25,
            "for_steps": 3,
            "cooldown_steps": 10,
            "action": "alert",
            **kw,
        }
    )


def nan_rule(**kw):
    return Rule(
        **{
            "name": "nan",
            "metric": "loss",
            "check": "finite",
            "action": "rollback",
            "skip_batches": "window",
            "cooldown_steps": 1,
            **kw,
        }
    )


RUN_ID = "run-1"


def outcome(engine, directive_id, result="applied", step=1, ranks=1, **extra):
    """What rank 0 reports once every rank handled a directive (parwatch.contract's counts)."""
    return engine.record_outcome(
        {
            "directive_id": directive_id,
            "run_id": RUN_ID,
            "outcome": result,
            "step": step,
            "counts": {result: ranks},
            "ranks": ranks,
            **extra,
        }
    )


class Run:
    """An engine fed one step at a time; the clock advances 1 s per step."""

    def __init__(self, rules, state_dir, clock=None):
        self.clock = clock or Clock()
        self.engine = GuardrailEngine(rules, state_dir, now=self.clock)
        self.engine.begin_run(RUN_ID)
        self.step = 0
        self.checkpoints = ()

    def feed(self, **series):
        self.step += 1
        self.clock.t += 1
        obs = Observation(
            self.step,
            self.clock.t,
            {m: v if isinstance(v, dict) else {"": v} for m, v in series.items()},
            self.checkpoints,
        )
        return self.engine.evaluate(obs)

    def state(self, name):
        return self.engine.states()[name]


def log_lines(state_dir):
    text = (state_dir / "decisions.jsonl").read_text()

    def reject(c):
        raise ValueError(f"non-standard JSON constant {c}")

    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def test_ok_pending_firing_ok(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    assert run.feed(pipeline_skew_ratio=1.1) == [] and run.state("skew")["state"] == "ok"
    assert run.feed(pipeline_skew_ratio=1.5) == []
    st = run.state("skew")
    assert (st["state"], st["failing_steps"], st["since_step"], st["last_value"]) == ("pending", 1, 2, 1.5)
    assert run.feed(pipeline_skew_ratio=1.6) == [] and run.state("skew")["state"] == "pending"
    (record,) = run.feed(pipeline_skew_ratio=1.7)
    assert run.state("skew")["state"] == "firing"
    assert (record["rule"], record["action"], record["step"], record["source"]) == ("skew", "alert", 4, "rule")
    ev = record["evidence"]
    assert ev["values"] == [1.5, 1.6, 1.7] and ev["window"] == [2, 4] and ev["threshold"] == 1.25
    assert ev["for_steps"] == 3 and ev["reduce"] == "max"
    # stays firing without acting again, then recovers
    assert run.feed(pipeline_skew_ratio=1.8) == [] and run.state("skew")["state"] == "firing"
    assert run.feed(pipeline_skew_ratio=1.0) == [] and run.state("skew")["state"] == "ok"


def test_a_passing_step_resets_pending(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.5)
    run.feed(pipeline_skew_ratio=1.5)
    run.feed(pipeline_skew_ratio=1.0)
    assert run.state("skew")["failing_steps"] == 0
    assert run.feed(pipeline_skew_ratio=1.5) == [] and run.feed(pipeline_skew_ratio=1.5) == []
    assert len(run.feed(pipeline_skew_ratio=1.5)) == 1


def test_reduce_over_series(tmp_path):
    rules = ruleset(
        Rule(name="excess", metric="bubble_excess_ratio", above=0.1, action="alert"),
        Rule(name="ranks", metric="rank_up", reduce="min", below=1, action="alert"),
        Rule(name="mean", metric="bubble_ratio", reduce="mean", above=0.3, action="alert"),
    )
    run = Run(rules, tmp_path)
    records = run.feed(
        bubble_excess_ratio={"stage=0": 0.01, "stage=1": 0.2},
        rank_up={"rank=0": 1, "rank=3": 0},
        bubble_ratio={"stage=0": 0.2, "stage=1": 0.35},
    )
    assert {r["rule"]: r["evidence"]["series"] for r in records} == {"excess": "stage=1", "ranks": "rank=3"}


def test_for_seconds_fires_by_time_without_new_observations(tmp_path):
    rule = Rule(name="ranks", metric="rank_up", reduce="min", below=1, for_seconds=60, action="alert")
    run = Run(ruleset(rule), tmp_path)
    assert run.feed(rank_up={"rank=0": 1, "rank=1": 0}) == []
    assert run.state("ranks")["state"] == "pending"
    run.clock.t += 30
    assert run.engine.check_no_data() == []
    run.clock.t += 31
    (record,) = run.engine.check_no_data()
    assert record["rule"] == "ranks" and run.state("ranks")["state"] == "firing"
    assert record["evidence"]["for_seconds"] == 60


def test_cooldown_blocks_a_second_action(tmp_path):
    run = Run(ruleset(skew_rule(for_steps=1, cooldown_steps=5)), tmp_path)
    assert len(run.feed(pipeline_skew_ratio=2)) == 1  # tick 1
    run.feed(pipeline_skew_ratio=1)
    assert run.feed(pipeline_skew_ratio=2) == []  # tick 3: within 5 steps of acting
    assert "cooldown" in run.state("skew")["reason"] and run.state("skew")["state"] == "firing"
    run.feed(pipeline_skew_ratio=1)
    run.feed(pipeline_skew_ratio=1)
    assert len(run.feed(pipeline_skew_ratio=2)) == 1  # tick 6: cooldown over


def test_no_data_is_a_finding_and_only_alerts(tmp_path):
    run = Run(ruleset(nan_rule(no_data_seconds=100), skew_rule()), tmp_path)
    assert run.engine.check_no_data() == []  # nothing runs yet: no finding before the first observation
    run.feed(loss=2.0, pipeline_skew_ratio=1.0)
    for _ in range(50):
        assert run.feed(pipeline_skew_ratio=1.0) == []  # loss absent, 51 s since last seen
    run.clock.t += 50
    (record,) = run.engine.check_no_data()
    assert (record["rule"], record["action"], record["directive_id"]) == ("nan", "alert", None)
    assert record["finding"] == "no-data" and "loss" in record["reason"]
    st = run.state("nan")
    assert (st["state"], st["reason"]) == ("firing", "no-data")
    assert run.engine.pending_directive() is None
    assert run.engine.check_no_data() == []  # recorded once
    assert run.state("skew")["state"] == "ok"  # skew has no no_data_seconds
    run.feed(loss=2.0)
    assert run.state("nan")["state"] == "ok"


def test_no_data_is_not_a_finding_while_paused(tmp_path):
    run = Run(ruleset(skew_rule(no_data_seconds=100)), tmp_path)
    run.feed(pipeline_skew_ratio=1.0)
    pause = run.engine.request("pause", "operator")["directive_id"]
    outcome(run.engine, pause, step=1)
    run.clock.t += 500
    assert run.engine.check_no_data() == []
    resume = run.engine.request("resume", "operator")["directive_id"]
    outcome(run.engine, resume, step=1)
    run.clock.t += 50
    assert run.engine.check_no_data() == []  # the clock restarts at resume
    run.clock.t += 60
    assert [r["finding"] for r in run.engine.check_no_data()] == ["no-data"]


def test_dry_run_records_but_hands_out_nothing(tmp_path):
    run = Run(ruleset(nan_rule(), enforce=False), tmp_path)
    run.checkpoints = (0,)
    (record,) = run.feed(loss=math.nan)
    assert record["action"] == "rollback" and record["enforced"] is False and record["directive_id"] is None
    assert run.engine.pending_directive() is None
    assert run.engine.request("pause", "operator")["enforced"] is False


def test_rollback_goes_before_the_failing_window_and_skips_it(tmp_path):
    rule = Rule(
        name="high", metric="loss", above=10, for_steps=3, cooldown_steps=3, action="rollback", skip_batches="window"
    )
    run = Run(ruleset(rule), tmp_path)
    for _ in range(4):
        run.feed(loss=2.0)
    run.checkpoints = (2, 4)
    run.feed(loss=20.0)  # step 5: window starts
    run.checkpoints = (2, 4, 6)  # a checkpoint saved inside the failing window is not trusted
    run.feed(loss=20.0)
    (record,) = run.feed(loss=20.0)  # step 7: fires
    assert record["evidence"]["window"] == [5, 7]
    assert (record["action"], record["checkpoint"], record["skip_batches"]) == ("rollback", 4, 3)
    directive = run.engine.pending_directive()
    assert directive == {
        "id": record["directive_id"],
        "action": "rollback",
        "run_id": RUN_ID,
        "to_step": 4,
        "skip_batches": 3,
        "reason": record["reason"],
    }


def test_fixed_skip_batches(tmp_path):
    run = Run(ruleset(nan_rule(skip_batches=7)), tmp_path)
    run.checkpoints = (0,)
    (record,) = run.feed(loss=math.inf)
    assert (record["checkpoint"], record["skip_batches"]) == (0, 7)


def test_rollback_without_a_checkpoint_escalates_to_pause(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.feed(loss=1.0)
    (record,) = run.feed(loss=math.nan)
    assert record["action"] == "pause" and record["escalated"] is True
    assert "no checkpoint before step 2" in record["reason"]
    assert run.engine.pending_directive()["action"] == "pause"


def test_a_window_rollback_firing_by_time_after_a_rollback_pauses(tmp_path):
    # Applying a rollback forgets the last step; a pending for_seconds rule that fires before the next
    # step cannot count its window's batches (this raised TypeError: None - checkpoint).
    rule = Rule(
        name="ranks",
        metric="rank_up",
        reduce="min",
        below=1,
        for_seconds=60,
        action="rollback",
        skip_batches="window",
        cooldown_steps=50,
    )
    run = Run(ruleset(rule), tmp_path)
    run.checkpoints = (4,)
    for _ in range(9):
        run.feed(rank_up={"rank=0": 1, "rank=1": 1})
    run.feed(rank_up={"rank=0": 1, "rank=1": 0})  # step 10: pending
    ordered = run.engine.request("rollback", "operator", to_step=4)
    outcome(run.engine, ordered["directive_id"], step=4, loaded_step=4)
    run.clock.t += 61
    (record,) = run.engine.check_no_data()
    assert record["rule"] == "ranks" and record["action"] == "pause" and record["escalated"] is True
    assert "no step evaluated since the last rollback" in record["reason"]


def test_repeated_rollbacks_escalate_after_max_rollbacks(tmp_path):
    run = Run(ruleset(nan_rule(), max_rollbacks=2, rollback_window_steps=100), tmp_path)
    run.checkpoints = (0,)
    actions = []
    for _ in range(3):
        run.feed(loss=1.0)
        run.feed(loss=1.0)
        actions += [r["action"] for r in run.feed(loss=math.nan)]
    assert actions == ["rollback", "rollback", "pause"]
    last = run.engine.decisions(1)[0]
    assert last["escalated"] is True and "max_rollbacks=2" in last["reason"]


def test_rollbacks_outside_the_window_do_not_count(tmp_path):
    run = Run(ruleset(nan_rule(), max_rollbacks=1, rollback_window_steps=3), tmp_path)
    run.checkpoints = (0,)
    actions = []
    for _ in range(2):
        for _ in range(3):
            run.feed(loss=1.0)
        actions += [r["action"] for r in run.feed(loss=math.nan)]
    assert actions == ["rollback", "rollback"]


def test_a_rollback_rule_failing_again_within_cooldown_pauses(tmp_path):
    run = Run(ruleset(nan_rule(cooldown_steps=20)), tmp_path)
    run.checkpoints = (0,)
    assert run.feed(loss=math.nan)[0]["action"] == "rollback"
    run.feed(loss=1.0)
    (record,) = run.feed(loss=math.nan)
    assert record["action"] == "pause" and record["escalated"] and "cooldown_steps=20" in record["reason"]


def test_spike_needs_a_baseline_then_fires(tmp_path):
    rule = Rule(name="spike", metric="loss", check="spike", factor=3.0, window_steps=10, action="alert")
    run = Run(ruleset(rule), tmp_path)
    assert run.feed(loss=2.0) == [] and run.feed(loss=20.0) == []  # too few values to judge
    for _ in range(4):
        assert run.feed(loss=2.0) == []
    (record,) = run.feed(loss=7.0)  # median of the previous values is 2.0
    assert record["evidence"]["baseline"] == 2.0 and record["evidence"]["factor"] == 3.0
    assert run.feed(loss=5.0) == [] and run.state("spike")["state"] == "ok"


def test_regression_judges_each_series_against_its_own_baseline(tmp_path):
    rule = Rule(
        name="coll", metric="collective_seconds_mean", check="regression", factor=2.0, window_steps=5, action="alert"
    )
    run = Run(ruleset(rule), tmp_path)
    for _ in range(5):
        run.feed(collective_seconds_mean={"op=all_reduce,group=tp": 0.002, "op=send,group=pp": 0.0001})
    # all_reduce at 1.5x (slow in absolute terms, fine for itself); send at 3x its own baseline
    (record,) = run.feed(collective_seconds_mean={"op=all_reduce,group=tp": 0.003, "op=send,group=pp": 0.0003})
    ev = record["evidence"]
    assert ev["series"] == "op=send,group=pp" and ev["baseline"] == 0.0001
    assert ev["values"] == [pytest.approx(3.0)]


def test_a_regression_no_larger_than_min_increase_is_no_finding(tmp_path):
    """A loopback send at 0.3 ms that CPU contention makes 1.5 ms (5x) is no degraded link under a 2 ms
    floor; the same path 2.5 ms above its median is. Without the floor both fire."""
    rule = Rule(
        name="coll",
        metric="collective_transfer_seconds",
        check="regression",
        factor=2.0,
        window_steps=5,
        min_increase=0.002,
        action="alert",
    )
    run = Run(ruleset(rule), tmp_path)
    for _ in range(5):
        run.feed(collective_transfer_seconds={"op=send,group=pp": 0.0003})
    assert run.feed(collective_transfer_seconds={"op=send,group=pp": 0.0015}) == []
    (record,) = run.feed(collective_transfer_seconds={"op=send,group=pp": 0.0028})
    assert record["evidence"]["series"] == "op=send,group=pp" and record["evidence"]["baseline"] == 0.0003
    assert record["evidence"]["min_increase"] == 0.002


def test_operator_requests(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    with pytest.raises(ValueError, match="no checkpoint"):
        run.engine.request("rollback", "operator")
    with pytest.raises(ValueError, match="no checkpoint"):
        run.engine.request("rollback", "operator", to_step=3)  # not known: not verified either
    run.checkpoints = (10, 20)
    run.feed(pipeline_skew_ratio=1.0)
    record = run.engine.request("rollback", "operator", reason="bad data", requested_by="alice")
    assert (record["action"], record["checkpoint"], record["source"], record["requested_by"]) == (
        "rollback",
        20,
        "operator",
        "alice",
    )
    assert run.engine.request("rollback", "operator", to_step=10, skip_batches=5)["checkpoint"] == 10
    for bad in (
        dict(action="explode", source="operator"),
        dict(action="pause", source="someone"),
        dict(action="rollback", source="operator", to_step=15),
        dict(action="pause", source="operator", skip_batches=3),
        dict(action="rollback", source="operator", skip_batches=-1),
    ):
        with pytest.raises(ValueError):
            run.engine.request(**bad)


def test_alertmanager_mirror_of_a_rule_that_acted_is_not_enforced_twice(tmp_path):
    run = Run(ruleset(nan_rule(cooldown_steps=10)), tmp_path)
    run.checkpoints = (0,)
    run.feed(loss=math.nan)
    record = run.engine.request("rollback", "alertmanager", rule="nan", requested_by="ParwatchNan")
    assert record["enforced"] is False and record["directive_id"] is None and record["alert_rule"] == "nan"


def test_one_outcome_record_completes_a_directive_for_every_rank(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.0)
    pause = run.engine.request("pause", "operator")["directive_id"]
    resume = run.engine.request("resume", "operator")["directive_id"]
    assert run.engine.pending_directive()["id"] == pause  # oldest first
    assert not run.engine.paused
    outcome(run.engine, pause, step=2, ranks=4)
    assert run.engine.paused and run.engine.pending_directive()["id"] == resume
    applied = run.engine.decisions(1)[0]
    assert applied == {
        "type": "applied",
        "directive_id": pause,
        "action": "pause",
        "decision_id": 1,
        "step": 2,
        "time": run.clock.t,
        "ranks": "0-3",
        "rank_count": 4,
        "counts": {"applied": 4},
    }
    outcome(run.engine, resume, step=3, ranks=4)
    assert not run.engine.paused and run.engine.pending_directive() is None
    (late,) = outcome(run.engine, resume, step=3, ranks=4)  # reported twice: recorded, not acted on
    assert late["note"].startswith("not outstanding") and not run.engine.paused
    assert [r["type"] for r in log_lines(tmp_path)] == ["decision", "decision", "applied", "applied", "applied"]


def test_a_substituted_rollback_records_the_step_loaded_and_forgets_later_checkpoints(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.checkpoints = (4, 8)
    for _ in range(9):
        run.feed(loss=1.0)
    (decision,) = run.feed(loss=math.nan)  # step 10
    assert decision["checkpoint"] == 8
    (record,) = outcome(run.engine, decision["directive_id"], "substituted", step=4, ranks=4, loaded_step=4)
    assert (record["type"], record["requested_step"], record["loaded_step"], record["substituted"]) == (
        "substituted",
        8,
        4,
        True,
    )
    assert run.engine.pending_directive() is None
    with pytest.raises(ValueError, match="not a known verified checkpoint"):
        run.engine.request("rollback", "operator", to_step=8)  # the abandoned timeline's


def test_a_failed_rollback_pauses_and_alerts_instead_of_unpausing(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.checkpoints = (4,)
    for _ in range(5):
        run.feed(loss=1.0)
    (decision,) = run.feed(loss=math.nan)
    assert decision["action"] == "rollback"
    failed, pause, alert = outcome(
        run.engine, decision["directive_id"], "failed", step=2, ranks=4, reasons={"checkpoint_corrupt": 4}
    )
    assert failed["type"] == "failed" and failed["reasons"] == {"checkpoint_corrupt": 4}
    assert (pause["action"], pause["escalated"], pause["failed_directive_id"]) == (
        "pause",
        True,
        decision["directive_id"],
    )
    assert alert["action"] == "alert" and "checkpoint_corrupt on 4 ranks" in alert["reason"]
    assert run.engine.pending_directive()["id"] == pause["directive_id"]
    assert not run.engine.paused  # until the run reports the pause applied
    outcome(run.engine, pause["directive_id"], step=2, ranks=4)
    assert run.engine.paused


def test_cancel_withdraws_an_outstanding_directive(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.0)
    pause = run.engine.request("pause", "operator")["directive_id"]
    record = run.engine.cancel(pause, requested_by="operator:alice")
    assert (record["type"], record["directive_id"], record["action"]) == ("cancelled", pause, "pause")
    assert run.engine.pending_directive() is None
    with pytest.raises(ValueError, match="not outstanding"):
        run.engine.cancel(pause)


def test_a_new_run_starts_a_clean_engine_and_the_old_one_is_archived(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.checkpoints = (0,)
    run.feed(loss=math.nan)  # a rollback stays outstanding when the run ends
    assert run.engine.pending_directive()["action"] == "rollback"
    assert run.engine.begin_run("run-2") is True
    assert run.engine.pending_directive() is None  # never handed to the next run
    assert run.engine.states()["nan"]["state"] == "ok" and not (tmp_path / "decisions.jsonl").exists()
    archived = [json.loads(line) for line in (tmp_path / "runs" / RUN_ID / "decisions.jsonl").read_text().splitlines()]
    assert [r["action"] for r in archived] == ["rollback"]
    with pytest.raises(ValueError, match="already ended"):
        run.engine.begin_run(RUN_ID)  # a late post of the old run does not take it back
    again = GuardrailEngine(ruleset(nan_rule()), tmp_path, now=run.clock)
    assert again.run_id == "run-2" and again.pending_directive() is None


def test_a_run_id_cannot_climb_out_of_the_archive(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path / "state")
    run.feed(loss=1.0)
    run.engine.begin_run("../../etc")
    run.engine.begin_run("run-3")
    assert (tmp_path / "state" / "runs" / "run-1").is_dir() and (tmp_path / "state" / "runs" / "_.._etc").is_dir()


def test_log_is_strict_json_with_nan_as_strings(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.checkpoints = (0,)
    run.feed(loss=math.nan)
    (record,) = log_lines(tmp_path)
    assert record["evidence"]["values"] == ["nan"]
    assert set(record) >= {
        "type",
        "id",
        "time",
        "step",
        "rule",
        "action",
        "source",
        "requested_by",
        "enforced",
        "reason",
        "evidence",
        "checkpoint",
        "skip_batches",
        "directive_id",
    }


def test_restart_continues_from_persisted_state(tmp_path):
    clock = Clock()
    rules = ruleset(skew_rule(), nan_rule())
    run = Run(rules, tmp_path, clock)
    run.checkpoints = (0,)
    run.feed(pipeline_skew_ratio=1.5, loss=1.0)
    run.feed(pipeline_skew_ratio=1.5, loss=math.nan)  # rollback directive, outstanding
    run.engine.request("pause", "operator")
    pause_id = run.engine.decisions(1)[0]["directive_id"]
    outcome(run.engine, pause_id, step=2)  # the rollback stays outstanding

    again = Run(rules, tmp_path, clock)
    again.step, again.checkpoints = run.step, run.checkpoints
    assert again.engine.paused
    assert again.engine.pending_directive()["action"] == "rollback"
    assert again.state("skew")["failing_steps"] == 2
    (record,) = again.feed(pipeline_skew_ratio=1.5, loss=1.0)  # the third failing step
    assert record["rule"] == "skew" and record["evidence"]["values"] == [1.5, 1.5, 1.5]
    assert record["id"] == 3  # ids continue after the rollback (1) and the pause (2)
    assert again.engine.request("resume", "operator")["directive_id"] == pause_id + 1
    assert [r["id"] for r in again.engine.decisions() if r["type"] == "decision"] == [1, 2, 3, 4]


def test_ids_continue_from_the_log_if_state_is_lost(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.0)
    first = run.engine.request("pause", "operator")
    for name in ("parwatch.db", "parwatch.db-wal", "parwatch.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    again = Run(ruleset(skew_rule()), tmp_path)
    assert again.engine.pending_directive()["id"] == first["directive_id"]  # the log says it is outstanding
    record = again.engine.request("resume", "operator")
    # decision ids continue from the log; directive ids only ever grow
    assert record["id"] == 2 and record["directive_id"] > first["directive_id"]


def test_reload_keeps_states_of_surviving_rules(tmp_path):
    run = Run(ruleset(skew_rule(), nan_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.5, loss=1.0)
    run.feed(pipeline_skew_ratio=1.5, loss=1.0)
    new_rule = Rule(name="excess", metric="bubble_excess_ratio", above=0.1, action="alert")
    run.engine.reload(ruleset(skew_rule(above=1.3), new_rule))
    states = run.engine.states()
    assert set(states) == {"skew", "excess"}
    assert states["skew"]["failing_steps"] == 2 and states["excess"]["state"] == "ok"
    (record,) = run.feed(pipeline_skew_ratio=1.5, bubble_excess_ratio={"stage=0": 0.0})
    assert record["rule"] == "skew" and record["evidence"]["threshold"] == 1.3


def test_a_repeated_step_is_evaluated_once(tmp_path):
    run = Run(ruleset(skew_rule()), tmp_path)
    run.feed(pipeline_skew_ratio=1.5)
    obs = Observation(run.step, run.clock.t, {"pipeline_skew_ratio": {"": 1.5}})
    for _ in range(3):
        assert run.engine.evaluate(obs) == []
    assert run.state("skew")["failing_steps"] == 1


def test_states_are_json_safe(tmp_path):
    run = Run(ruleset(nan_rule()), tmp_path)
    run.checkpoints = (0,)
    run.feed(loss=math.inf)
    st = run.state("nan")
    assert st["last_value"] == "inf" and json.dumps(st, allow_nan=False)
    assert set(st) >= {"state", "reason", "failing_steps", "since_step", "last_value", "threshold", "last_seen_time"}


def test_unusable_values_are_dropped_and_schema_strings_decoded(tmp_path):
    run = Run(ruleset(nan_rule(), skew_rule(for_steps=1)), tmp_path)
    run.checkpoints = (0,)
    records = run.feed(loss={"": "nan"}, pipeline_skew_ratio={"": None, "x": "junk"})
    assert [r["rule"] for r in records] == ["nan"]
    assert run.state("skew")["last_seen_time"] is None  # no usable value: not seen
