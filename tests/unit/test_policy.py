"""The engine split in two (issue 40 item 4): a pure decision core (guardrails/policy.py) and the store, whose
database is the one source of truth (decisions.jsonl is written from it; read as the state only when the
database holds nothing)."""

from __future__ import annotations

import builtins
import json
import math
import sqlite3
import time

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.policy import Observation, Policy
from parwatch.guardrails.rules import default_rules


def _refuse(*args, **kwargs):
    raise AssertionError("the policy did I/O or read a clock of its own")


def test_the_policy_decides_without_a_state_dir_or_a_clock_of_its_own(monkeypatch):
    t = [1000.0]
    policy = Policy(default_rules(), now=lambda: t[0], started=900.0)
    policy.begin_run("r")
    for refused in ((builtins, "open"), (sqlite3, "connect"), (time, "time"), (time, "monotonic")):
        monkeypatch.setattr(*refused, _refuse)
    for step, loss in ((1, 2.0), (2, 2.0), (3, math.nan)):
        t[0] += 1
        made = policy.evaluate(Observation(step, t[0], {"loss": {"": loss}}, checkpoints=(0, 1)))
    (rollback,) = made
    assert (rollback["rule"], rollback["action"], rollback["checkpoint"]) == ("nonfinite-loss", "rollback", 1)
    delivered = policy.pending_directive(deliver=True)
    assert delivered is not None and delivered["id"] == rollback["directive_id"]
    # What it made is owed to the store, in order: the decision, then the delivery's record.
    assert [r["type"] for r in policy.unsaved] == ["decision", "delivered"]
    assert policy.changed
    monkeypatch.undo()
    # Its saved state, restored into a fresh policy, is the same state.
    again = Policy(default_rules(), now=lambda: t[0], started=900.0)
    state, rules, directives = policy.snapshot()
    again.restore(
        {
            "run": {"run_id": "r", **state},
            "records": list(policy.recent),
            "directives": directives,
            "rules": {name: json.dumps(saved) for name, saved in rules.items()},
            "next_decision_id": policy.next_decision_id,
            "next_directive_id": state["next_directive_id"],
        }
    )
    assert json.dumps(again.snapshot()) == json.dumps(policy.snapshot())  # as the store writes it (NaN != NaN)
    assert again.rollbacks_delivered == 1


def test_the_log_is_written_from_the_database_never_read_back_while_the_database_holds_the_state(tmp_path):
    engine = GuardrailEngine(default_rules(), tmp_path, now=lambda: 1000.0)
    engine.begin_run("r")
    made = engine.request("pause", "operator", reason="held")
    engine.close()
    log = tmp_path / "decisions.jsonl"
    forged = dict(made, id=made["id"] + 1, directive_id=made["directive_id"] + 1, reason="written in the log only")
    log.write_text(json.dumps(forged) + "\n")  # the log lost its lines and gained one the database never held
    again = GuardrailEngine(default_rules(), tmp_path, now=lambda: 1000.0)
    assert [d["id"] for d in again.directive_states()] == [made["directive_id"]]  # the database's, not the log's
    assert [r["reason"] for r in again.decisions()] == ["held"]
    # The log is left as it is when its last line is none of the database's (edited by hand) ...
    assert [json.loads(line)["reason"] for line in log.read_text().splitlines()] == ["written in the log only"]
    log.unlink()
    GuardrailEngine(default_rules(), tmp_path, now=lambda: 1000.0)
    # ... and given back what the database holds when it lacks it.
    assert [json.loads(line)["reason"] for line in log.read_text().splitlines()] == ["held"]
