"""The goodput ledger's accounting (parwatch.collector.ledger) on hand-made periods: every second
in exactly one category, a rollback's discarded steps moved to wasted exactly, pauses and loads
as gaps. Real runs: tests/dist/test_ledger_runs.py."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from parwatch import ledger_view
from parwatch.collector.ledger import Ledger, shares_of
from parwatch.collector.stats import StepStats
from parwatch.vocabulary import SpanKind
from parwatch.vocabulary import TimeCategory as C
from parwatch.wire.steps import GlobalStage


def stats(compute=0.0, optimizer=0.0, data=0.0, comm=0.0, comm_in_compute=0.0) -> StepStats:
    s = StepStats()
    s.add(SpanKind.FORWARD, compute, {})
    if optimizer:
        s.add(SpanKind.OPTIMIZER, optimizer, {})
    if data:
        s.add(SpanKind.DATA, data, {})
    if comm:
        s.add(SpanKind.COLLECTIVE, comm, {"op": "all_reduce", "group": "dp"})
    if comm_in_compute:
        s.add(SpanKind.COLLECTIVE, comm_in_compute, {"op": "all_reduce", "group": "tp"}, SpanKind.FORWARD)
    return s


def run_step(ledger: Ledger, step: int, start: float, seconds: float, st: StepStats) -> float:
    idle = max(0.0, seconds - st.compute_seconds - st.other_seconds)
    ledger.step(step, start + seconds, st, idle)
    return start + seconds


def test_a_step_is_split_by_its_spans_and_the_bubble_by_the_theory_until_causes_arrive():
    ledger = Ledger(100.0, theory=0.2)
    ledger.gap(103.0)  # the start boundary: 3 s of startup
    t = run_step(ledger, 1, 103.0, 1.0, stats(compute=0.6, optimizer=0.05, data=0.05, comm=0.1, comm_in_compute=0.1))
    got = ledger.seconds
    assert got[C.STARTUP] == pytest.approx(3.0)
    assert got[C.PRODUCTIVE] == pytest.approx(0.5)  # forward 0.6 less the TP all-reduce inside it
    assert got[C.EXPOSED_COMM] == pytest.approx(0.2)  # that all-reduce and the DP one outside any span
    assert got[C.OPTIMIZER] == pytest.approx(0.05) and got[C.DATA_WAIT] == pytest.approx(0.05)
    # idle 0.3 less the DP all-reduce = 0.2 of bubble: the schedule's share of it is 0.2/0.8 x 0.5
    assert got[C.BUBBLE_SCHEDULE] == pytest.approx(0.125)
    assert got[C.BUBBLE_WAIT] == pytest.approx(0.075)
    assert ledger.total() == pytest.approx(t - 100.0, abs=1e-12)
    ledger.split = (0.5, 0.25, 0.25)  # the causes the shipper thread found for this stage
    t = run_step(ledger, 2, t, 1.0, stats(compute=0.6))
    assert got[C.BUBBLE_IMBALANCE] == pytest.approx(0.1)
    assert ledger.total() == pytest.approx(t - 100.0, abs=1e-12)


def test_a_rollback_moves_exactly_the_discarded_steps_productive_time_to_wasted():
    ledger = Ledger(0.0)
    ledger.gap(1.0)
    t = 1.0
    for step in range(1, 9):  # step s computes 0.1 * s
        t = run_step(ledger, step, t, 1.0, stats(compute=0.1 * step))
    productive = ledger.seconds[C.PRODUCTIVE]
    ledger.rollback(5, t + 1.5)  # reported once the load is done (1.5 s) ...
    ledger.gap(t + 2.0)  # ... then the resume boundary: 2 s between the boundaries
    assert ledger.seconds[C.WASTED] == pytest.approx(0.6 + 0.7 + 0.8)
    assert ledger.seconds[C.PRODUCTIVE] == pytest.approx(productive - 2.1)
    assert ledger.seconds[C.CHECKPOINT_LOAD] == pytest.approx(2.0)
    t += 2.0
    for step in range(6, 9):  # trained again, then rolled back again to 3: 4..5 of the first pass too
        t = run_step(ledger, step, t, 1.0, stats(compute=0.05))
    ledger.rollback(3, t)
    assert ledger.seconds[C.WASTED] == pytest.approx(2.1 + 0.4 + 0.5 + 3 * 0.05)
    assert ledger.total() == pytest.approx(t, abs=1e-9)


def test_a_pause_is_paused_time_until_the_resume():
    ledger = Ledger(0.0)
    ledger.gap(1.0)
    t = run_step(ledger, 1, 1.0, 1.0, stats(compute=0.5))
    ledger.paused(t + 0.01)
    for beat in range(1, 5):
        ledger.gap(t + 0.01 + beat * 0.2, holding=True)
    ledger.gap(t + 2.0)  # the resume boundary
    assert ledger.seconds[C.PAUSED] == pytest.approx(2.0 - 0.01)
    t = run_step(ledger, 2, t + 2.0, 1.0, stats(compute=0.5))
    assert ledger.seconds[C.PAUSED] == pytest.approx(1.99)  # the step after the resume is not paused
    assert ledger.total() == pytest.approx(t)


def test_a_device_clock_period_longer_than_the_host_one_is_scaled_into_it():
    ledger = Ledger(0.0)
    ledger.step(1, 1.0, stats(compute=0.8, optimizer=0.4), 0.0)  # spans 1.2 s in a 1.0 s period
    assert ledger.total() == pytest.approx(1.0)
    assert ledger.seconds[C.PRODUCTIVE] == pytest.approx(0.8 / 1.2)


def test_totals_over_ranks_goodput_ettr_and_the_bubble_shares():
    # Two ranks' counters: productive is gross, 1 s of it discarded (wasted) on rank 1.
    ranks = [
        {"productive": 3.0, "bubble_schedule": 1.0, "startup": 0.5, "paused": 0.5},
        {"productive": 4.0, "bubble_schedule": 1.0, "startup": 0.5, "wasted": 1.0, "paused": 0.5},
    ]
    total = ledger_view.totals(ranks)
    assert total["rank_seconds"] == pytest.approx(11.0) and total["seconds"]["productive"] == pytest.approx(6.0)
    assert total["goodput_ratio"] == pytest.approx(6 / 11)
    assert total["ettr"] == pytest.approx(1 - 3 / 11)  # startup, paused and wasted are outside training
    assert ledger_view.totals([]) is None
    assert ledger_view.as_counters({"productive": 6.0, "wasted": 1.0})["productive"] == 7.0
    assert ledger_view.line(total).startswith("time: goodput 54.5%, ETTR 72.7% of 11.0 rank-seconds; productive")
    stage = GlobalStage(stage=0, compute_seconds=1.0, idle_seconds=0.25, step_seconds=1.25, bubble_ratio=0.2)
    causes = replace(stage, bubble_schedule_ratio=0.2, bubble_imbalance_ratio=-0.01, bubble_wait_ratio=0.05)
    assert shares_of(causes) == (pytest.approx(0.8), 0.0, pytest.approx(0.2))
    assert shares_of(stage) is None


def test_a_restart_carries_the_ended_process_and_counts_the_gap_as_down():
    """Process 1 ran 10 s (from t=100) and reported steps 1-4; process 2 started at t=113 and resumed from
    checkpoint 2: 3 s down, steps 3-4's productive time wasted, and the counters cover 100..(113 + 5)."""
    ended = ledger_view.Process(100.0, {"startup": 2.0, "productive": 8.0}, [(1, 2.0), (2, 4.0), (3, 6.0), (4, 8.0)])
    carried = ledger_view.restarted({}, ended, restarted_at=113.0, resumed_step=2)
    assert carried == {"startup": 2.0, "productive": 8.0, "down": 3.0, "wasted": 4.0}
    new = ledger_view.Process(113.0, {"startup": 1.0, "productive": 4.0}, [(3, 2.0), (4, 4.0)])
    total = ledger_view.across_restarts([new, ended])  # any order: by start time
    assert total == {"startup": 3.0, "productive": 12.0, "down": 3.0, "wasted": 4.0}
    assert ledger_view.wall_of(total) == pytest.approx(118.0 - 100.0)
    # Resumed before every step it kept (a restart from scratch, or from further back): all of it.
    assert ended.discarded_after(0) == 8.0 and ended.discarded_after(4) == 0.0
    # After a rollback inside the process, its last timeline's steps decide: step 3 replayed at 7.0 s.
    replayed = ledger_view.Process(0.0, {}, [(1, 2.0), (2, 4.0), (3, 6.0), (3, 7.0), (4, 9.0)])
    assert replayed.discarded_after(3) == 2.0
    # A restart that overlaps the ended process's counted time (clocks apart) adds no negative down.
    assert ledger_view.restarted({}, ended, restarted_at=105.0, resumed_step=4)["down"] == 0.0
    assert ledger_view.same_process(100.0, 100.4) and not ledger_view.same_process(100.0, 113.0)
