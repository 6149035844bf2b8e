"""A rule that stays failing acts again: across a rollback, a restart (resume) and a cancel (issue 42).

On d484f20 the engine's "failed again: pause" path ran only when a rule went from ok to firing. A
bad batch replayed right after its rollback (a checkpoint every step, the integrations ignoring
skip_batches), or a restart resuming NaN weights, kept the nonfinite-loss rule firing without a
finite step in between: it never acted again and the run trained on NaN to the end. These feed the
packaged default rules exactly those step sequences.
"""

from __future__ import annotations

import math

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import default_rules

RUN = "run-42"
NAN = math.nan


class Steps:
    """An engine with the default rules, fed the loss of one step at a time; a checkpoint every step."""

    def __init__(self, tmp_path):
        self.t = 1000.0
        self.started = 900.0  # rank 0's process start
        self.engine = GuardrailEngine(default_rules(), tmp_path, now=lambda: self.t)
        self.engine.begin_run(RUN)

    def step(self, step: int, loss: float) -> list[dict]:
        self.t += 1
        return self.engine.evaluate(
            Observation(step, self.t, {"loss": {"": loss}}, tuple(range(0, step)), process_start_time=self.started)
        )

    def apply(self, directive: dict, loaded: int | None = None) -> None:
        self.engine.record_outcome(
            {
                "directive_id": directive["directive_id"],
                "run_id": RUN,
                "outcome": "applied",
                "step": loaded if loaded is not None else 0,
                "loaded_step": loaded,
                "counts": {"applied": 2},
                "ranks": 2,
            }
        )

    def nonfinite(self) -> list[dict]:
        return [d for d in self.engine.decisions(1000) if d.get("rule") == "nonfinite-loss"]


def _first_nan_rolls_back(run: Steps) -> dict:
    for s in range(1, 6):
        assert run.step(s, 2.0) == []
    (rollback,) = run.step(6, NAN)
    assert (rollback["action"], rollback["checkpoint"], rollback["skip_batches"]) == ("rollback", 5, 1)
    return rollback


def test_a_bad_batch_replayed_right_after_its_rollback_pauses_the_run(tmp_path):
    run = Steps(tmp_path)
    rollback = _first_nan_rolls_back(run)
    run.apply(rollback, loaded=5)
    # The loader ignored skip_batches: the replay meets the bad batch again at once, then NaN weights.
    (again,) = run.step(6, NAN)
    assert again["rule"] == "nonfinite-loss" and again["action"] == "pause" and again["escalated"]
    assert "after the rollback to step 5" in again["reason"], again["reason"]
    assert run.engine.pending_directive()["action"] == "pause"
    for s in range(7, 90):  # paused: while the pause is outstanding and then in force, nothing more
        run.step(s, NAN)
    assert [d["action"] for d in run.nonfinite() if d["enforced"]] == ["rollback", "pause"]


def test_a_restart_resuming_nan_weights_pauses_the_run(tmp_path):
    run = Steps(tmp_path)
    rollback = _first_nan_rolls_back(run)
    run.apply(rollback, loaded=5)  # checkpoint 5 loaded; step 6 passes, step 7's NaN pauses (as above)
    run.step(6, 1.0)
    (paused,) = run.step(7, NAN)
    assert paused["action"] == "pause" and paused["escalated"]
    # Killed and restarted with --resume from its newest checkpoint, whose weights are NaN: a new rank 0
    # process one step on from the last one judged, the rule still firing (nothing finite in between).
    run.apply(paused)
    run.started = run.t
    (again,) = run.step(8, NAN)
    assert again["action"] == "pause" and again["escalated"] and again["enforced"], again
    assert "after a restart of the trainer at step 8" in again["reason"], again["reason"]


def test_a_cancelled_rollback_then_nan_again_acts_again_then_pauses(tmp_path):
    run = Steps(tmp_path)
    rollback = _first_nan_rolls_back(run)
    run.engine.cancel(rollback["directive_id"], "operator")
    (second,) = run.step(7, NAN)
    assert second["action"] == "rollback" and second["rearmed"], second
    run.apply(second, loaded=second["checkpoint"])
    (third,) = run.step(second["checkpoint"] + 1, NAN)
    assert third["action"] == "pause" and third["escalated"], third
