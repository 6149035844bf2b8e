"""The check before the optimizer step (parwatch.contract.step_check): what every rank decides, together.

Ranks are threads here, joined by a real SUM all-reduce over a barrier, so each rank decides from the
sums alone, as on gloo (tests/dist/test_step_check_trainer.py runs it on real ranks).
"""

from __future__ import annotations

import math
import threading

import pytest

from parwatch.contract import HookRegistry, Observer, StepCheck, StepPolicy, StepReading
from parwatch.guardrails.rules import default_rules
from parwatch.vocabulary import Event, StepAction, StepFault, Triage

NAN = math.nan


class ThreadGroup:
    """A SUM all-reduce over `world` threads (each call is one collective every thread joins)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._parts: list = [None] * world
        self._out: list[float] = []
        self.calls: list[int] = []  # width of each collective (rank 0's record)

    def all_reduce(self, rank: int):
        def reduce(values: list[float]) -> list[float]:
            self._parts[rank] = list(values)
            if self._barrier.wait() == 0:
                self._out = [sum(col) for col in zip(*self._parts)]
                self.calls.append(len(values))
            self._barrier.wait()
            return list(self._out)

        return reduce


class Events(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def on_event(self, name, attrs):
        self.events.append((name, attrs))


class Passes:
    """One rank's readings of one step: the first pass, then each re-run's."""

    def __init__(self, readings: list[dict], rank: int, reruns: list[int]) -> None:
        self.passes, self.rank, self.reruns = iter(readings), rank, reruns
        self.current = next(self.passes)

    def measure(self) -> StepReading:
        return self.current.get(self.rank, StepReading())

    def rerun(self) -> None:
        self.reruns[self.rank] += 1
        self.current = next(self.passes)


def run_ranks(world: int, steps: list[dict], policy: StepPolicy | None = None):
    """Each rank checks `steps` in order: {"step", "readings": [per pass: {rank: StepReading}]}.
    Returns (verdicts by rank, events of rank 0, collective widths, re-runs by rank)."""
    group = ThreadGroup(world)
    verdicts: list[list] = [[] for _ in range(world)]
    reruns = [0] * world
    events = Events()
    errors = []

    def rank_main(rank: int) -> None:
        registry = HookRegistry()
        if rank == 0:
            registry.register(events)
        check = StepCheck(rank, world, group.all_reduce(rank), policy=policy, registry=registry)
        try:
            for spec in steps:
                passes = Passes(spec["readings"], rank, reruns)
                verdicts[rank].append(check.run(spec["step"], passes.measure, passes.rerun, batch=spec["step"] + 100))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return verdicts, events.events, group.calls, reruns


def loss_on(rank: int, value: float, last: int = 2) -> dict:
    """Readings where `last` reports `value` as its loss and every other rank none."""
    return {last: StepReading(loss=value, grad_sq=1.0), **{r: StepReading(grad_sq=1.0) for r in range(last)}}


def good(step: int, loss: float = 2.0) -> dict:
    return {"step": step, "readings": [loss_on(2, loss)]}


def test_a_good_step_costs_one_small_all_reduce_and_is_applied():
    verdicts, events, calls, reruns = run_ranks(3, [good(1)])
    assert [v[0].applied for v in verdicts] == [True] * 3 and [v[0].action for v in verdicts] == [None] * 3
    assert calls == [6] and reruns == [0, 0, 0] and events == []
    assert verdicts[0][0].loss == 2.0


def test_a_transient_nan_is_rerun_applied_and_names_the_rank_that_produced_it():
    # Rank 1's gradients are NaN once (silent data corruption); the re-run is clean.
    bad = {**loss_on(2, 2.0), 1: StepReading(grads_finite=False, grad_sq=NAN)}
    verdicts, events, calls, reruns = run_ranks(3, [{"step": 4, "readings": [bad, loss_on(2, 1.5)]}])
    for v in (r[0] for r in verdicts):  # every rank decides the same
        assert (v.applied, v.action, v.triage, v.fault, v.ranks) == (
            True,
            StepAction.RERUN,
            Triage.TRANSIENT,
            StepFault.NONFINITE,
            (1,),
        )
        assert v.loss == 1.5 and v.batch == 104
        assert v.evidence["first"]["nonfinite_grads"] == [1] and v.evidence["first"]["grad_sq_sum"] == "nan"
    assert reruns == [1, 1, 1]
    assert calls == [6, 3, 6]  # the check, the naming (one float a rank), the re-run's check
    assert [name for name, _ in events] == [Event.STEP_RERUN, Event.STEP_CHECKED]
    assert events[1][1]["verdict"]["triage"] == "transient" and events[1][1]["verdict"]["ranks"] == [1]


def test_a_nan_loss_names_the_rank_that_computed_it_not_every_rank_its_gradients_reached():
    poisoned = {
        2: StepReading(loss=NAN, grads_finite=False),
        0: StepReading(grads_finite=False),
        1: StepReading(grads_finite=False),
    }
    verdicts, *_ = run_ranks(3, [{"step": 2, "readings": [poisoned, loss_on(2, 2.0)]}])
    assert verdicts[0][0].ranks == (2,) and verdicts[0][0].evidence["first"]["nonfinite_grads"] == [0, 1, 2]


def test_a_persistent_nan_is_skipped_and_the_third_skip_in_the_window_pauses():
    bad_batch = {
        2: StepReading(loss=NAN, grads_finite=False),
        0: StepReading(grads_finite=False),
        1: StepReading(grads_finite=False),
    }
    steps = [
        good(1),
        {"step": 2, "readings": [bad_batch, bad_batch]},
        good(3),
        {"step": 4, "readings": [bad_batch, bad_batch]},
        {"step": 5, "readings": [bad_batch, bad_batch]},
    ]
    verdicts, events, calls, reruns = run_ranks(3, steps)
    v = verdicts[1]
    assert [x.applied for x in v] == [True, False, True, False, False]
    assert [x.action for x in v] == [None, StepAction.SKIP, None, StepAction.SKIP, StepAction.PAUSE]
    assert [x.triage for x in v[1::2]] == [Triage.PERSISTENT] * 2 and v[4].triage == Triage.PERSISTENT
    assert v[1].ranks == (2,) and v[1].batch == 102
    assert v[4].evidence["skipped_steps"] == [2, 4, 5] and "pause_after_skips=3" in v[4].evidence["pause"]
    assert reruns == [3, 3, 3]
    assert [e[1]["verdict"]["action"] for e in events if e[0] == Event.STEP_CHECKED] == ["skip", "skip", "pause"]


def test_skips_outside_the_window_do_not_count():
    bad = {"readings": [loss_on(2, NAN)] * 2}
    steps = [{"step": 1, **bad}, {"step": 6, **bad}, {"step": 7, **bad}]
    verdicts, *_ = run_ranks(3, steps, StepPolicy(skip_window_steps=5))
    assert [x.action for x in verdicts[0]] == [StepAction.SKIP, StepAction.SKIP, StepAction.SKIP]


def test_a_spike_that_the_rerun_reproduces_is_data_caused_and_skipped_and_one_that_does_not_is_transient():
    steps = [good(s, 2.0 + 0.01 * s) for s in range(1, 6)]
    steps.append({"step": 6, "readings": [loss_on(2, 9.0), loss_on(2, 9.0)]})  # 9 > 3 x median 2.03
    steps.append({"step": 7, "readings": [loss_on(2, 9.0), loss_on(2, 2.0)]})
    steps.append(good(8, 6.0))  # under 3 x 2.03: no spike
    verdicts, _, _, reruns = run_ranks(3, steps)
    v = verdicts[0]
    assert (v[5].action, v[5].triage, v[5].fault, v[5].applied) == (
        StepAction.SKIP,
        Triage.DATA_CAUSED,
        StepFault.SPIKE,
        False,
    )
    assert v[5].ranks == (2,) and v[5].evidence["first"]["baseline"] == pytest.approx(2.03)
    assert (v[6].action, v[6].triage, v[6].applied) == (StepAction.RERUN, Triage.TRANSIENT, True)
    assert v[7].action is None and reruns == [2, 2, 2]


def test_no_spike_is_judged_before_the_baseline_has_its_values():
    verdicts, *_ = run_ranks(3, [good(1, 2.0), good(2, 50.0)])
    assert [x.action for x in verdicts[0]] == [None, None]


def test_without_a_rerun_a_bad_step_is_skipped_untriaged():
    group = ThreadGroup(1)
    check = StepCheck(0, 1, group.all_reduce(0), registry=HookRegistry())
    verdict = check.run(3, lambda: StepReading(loss=NAN), None)
    assert (verdict.action, verdict.triage, verdict.applied, verdict.ranks) == (
        StepAction.SKIP,
        Triage.UNTRIAGED,
        False,
        (0,),
    )


def test_the_spike_terms_are_the_sidecars_loss_spike_rule():
    rule = default_rules().rule("loss-spike")
    policy = StepPolicy()
    assert (policy.spike_factor, policy.spike_window) == (rule.factor, rule.window_steps)


@pytest.mark.parametrize(
    "kwargs", [{"spike_factor": 1.0}, {"spike_window": 1}, {"pause_after_skips": -1}, {"skip_window_steps": 0}]
)
def test_a_policy_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError, match="StepPolicy"):
        StepPolicy(**kwargs)
