"""Rank 0's own guardrail while its sidecar (the leader) is unreachable (issue 24, item 6): a
non-finite loss the leader never saw pauses the run locally; the leader, back, records that decision
and rolls back once."""

from __future__ import annotations

import json

from parwatch.collector.fallback import LOCAL_DECISIONS_FILE, LocalGuard
from parwatch.collector.shipper import Delivery
from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import default_rules
from parwatch.vocabulary import Outcome
from parwatch.wire.codec import decode, encode
from parwatch.wire.steps import OutcomeRecord


def _guard(tmp_path, since=1234.5):
    return LocalGuard("r", lambda: 2000.0, lambda: since, str(tmp_path))


def _dropped():
    d = Delivery()
    d.accepted = False
    return d


def test_a_nonfinite_loss_the_sidecar_took_is_left_to_the_leader(tmp_path):
    guard = _guard(tmp_path)
    delivery = Delivery()
    guard.loss(7, float("nan"), delivery)
    assert guard.offer([4]) is None  # still queued: not known yet
    delivery.accepted = True
    assert guard.offer([4]) is None and guard.offer([4]) is None
    assert guard.decisions == 0


def test_the_last_steps_nonfinite_loss_is_the_guards_though_its_summary_was_taken(tmp_path):
    """The leader judges step n in step n+1's view: after the last step none comes."""
    guard = _guard(tmp_path)
    delivery = Delivery()
    guard.loss(8, float("nan"), delivery)
    delivery.accepted = True
    guard.never_judged(7)  # another step's: nothing changes
    guard.never_judged(8)
    pause = guard.offer([4, 6])
    assert pause is not None and pause.action == "pause" and guard.decisions == 1


def test_a_rollback_forgets_the_watched_loss_of_the_discarded_steps(tmp_path):
    guard = _guard(tmp_path)
    guard.loss(6, float("nan"), _dropped())
    guard.rolled_back()
    assert guard.offer([4]) is None and guard.decisions == 0


def test_a_finite_loss_is_never_watched(tmp_path):
    guard = _guard(tmp_path)
    guard.loss(7, 1.5, _dropped())
    assert guard.offer([4]) is None


def test_a_dropped_nonfinite_loss_pauses_once_with_an_id_above_every_id_seen(tmp_path):
    guard = _guard(tmp_path)
    guard.saw(40, handled=True)
    guard.saw(42)  # in a reply, never offered to the ranks
    guard.loss(7, float("inf"), _dropped())
    directive = guard.offer([4])
    assert directive.action.value == "pause" and directive.id == 43 and directive.run_id == "r"
    assert guard.offer([4]) is None  # one decision per event
    guard.loss(8, float("nan"), _dropped())  # the next NaN step, before the leader heard of the first
    assert guard.offer([4]) is None
    outcome = OutcomeRecord(directive_id=43, run_id="r", outcome=Outcome.APPLIED, step=8, ranks=4)
    record = guard.annotate(outcome)
    local = record.local
    assert local is not None
    assert (local.step, local.loss, local.after, local.checkpoints) == (7, "inf", 40, [4])
    assert local.unreachable_since == 1234.5 and local.action == "pause"
    assert guard.annotate(outcome).local is None  # only once
    (written,) = [json.loads(line) for line in (tmp_path / LOCAL_DECISIONS_FILE).read_text().splitlines()]
    assert written["directive_id"] == 43 and written["step"] == 7
    assert decode(encode(record), OutcomeRecord) == record  # the wire accepts it


def _engine(tmp_path):
    engine = GuardrailEngine(default_rules(), tmp_path, now=lambda: 3000.0)
    engine.begin_run("r")
    engine.evaluate(Observation(step=1, time=3000.0, series={"loss": {"": 2.0}}, checkpoints=(0,)))
    return engine


def _local_outcome(did, step=7, after=0, checkpoints=(4,)):
    return {
        "directive_id": did,
        "run_id": "r",
        "outcome": "applied",
        "step": step + 1,
        "loaded_step": None,
        "counts": {"applied": 4},
        "reasons": {},
        "ranks": 4,
        "local": {
            "rule": "nonfinite-loss",
            "action": "pause",
            "step": step,
            "loss": float("nan"),
            "time": 2990.0,
            "after": after,
            "checkpoints": list(checkpoints),
            "unreachable_since": 2980.0,
            "reason": "nonfinite-loss: loss nan at step 7",
        },
    }


def test_the_leader_records_a_local_pause_and_rolls_back_once(tmp_path):
    engine = _engine(tmp_path)
    did = engine.policy.directives.next_id + 5
    records = engine.record_outcome(_local_outcome(did))
    kinds = [(r["type"], r.get("action"), r.get("source")) for r in records]
    assert kinds == [("decision", "pause", "rank0"), ("applied", "pause", None), ("decision", "rollback", "rule")]
    assert records[0]["local"] is True and records[0]["directive_id"] == did
    rollback = records[2]
    assert rollback["rule"] == "nonfinite-loss" and rollback["checkpoint"] == 4 and rollback["directive_id"] > did
    assert engine.pending_directive()["id"] == rollback["directive_id"]
    # The same record again (its reply was lost): nothing new is decided.
    again = engine.record_outcome(_local_outcome(did))
    assert [r["type"] for r in again] == ["applied"] and "not outstanding" in again[0]["note"]
    assert sum(1 for r in engine.decisions(100) if r.get("action") == "rollback") == 1


def test_a_leader_directive_rank0_never_took_is_renumbered_above_the_local_one(tmp_path):
    engine = _engine(tmp_path)
    mine = engine.request("pause", "operator")["directive_id"]  # created while rank 0 could not hear it
    records = engine.record_outcome(_local_outcome(mine, after=mine - 1))  # rank 0 chose the same id
    assert records[0]["renumbered"] == {mine: mine + 1}
    assert engine.policy.directives.outstanding[0].directive.id == mine + 1


def test_a_renumbered_directive_keeps_its_new_id_when_the_state_is_recovered_from_the_log(tmp_path):
    """Recovered from decisions.jsonl alone, the directive came back under its old id, which rank 0 ignores
    (at or below the last it handled): its pause would have been lost."""
    engine = _engine(tmp_path)
    mine = engine.request("pause", "operator")["directive_id"]
    engine.record_outcome(_local_outcome(mine, after=mine - 1))  # and the rule's rollback after it
    before = [d["id"] for d in engine.directive_states()]
    assert before[0] == mine + 1
    engine.close()
    for suffix in ("", "-wal", "-shm"):  # the database is lost; decisions.jsonl is what is left
        (tmp_path / f"parwatch.db{suffix}").unlink(missing_ok=True)
    again = GuardrailEngine(default_rules(), tmp_path, now=lambda: 3000.0)
    assert [d["id"] for d in again.directive_states()] == before
    assert again.request("resume", "operator")["directive_id"] == max(before) + 1
