"""Rank 0's global view gets its bubble split into schedule, imbalance and wait (on the shipper's thread)."""

from __future__ import annotations

import pytest

from parwatch.collector.causes import CauseSplitter
from parwatch.trainer.schedules import pipeline_order


def stage(s, bubble, fwd, bwd):
    return {
        "stage": s,
        "bubble_ratio": bubble,
        "forward_seconds": fwd,
        "backward_seconds": bwd,
        "backward_weight_seconds": 0.0,
        "loss_seconds": 0.0,
    }


def test_a_uniform_pipeline_has_only_the_schedules_bubble_and_a_slow_stage_adds_imbalance():
    splitter = CauseSplitter()
    theory = splitter.set_order(pipeline_order("1f1b", 2, 4))
    assert theory == pytest.approx(1 / 5)
    uniform = {"global": {"stages": [stage(0, 0.25, 0.04, 0.08), stage(1, 0.25, 0.04, 0.08)]}}
    splitter.add_causes(uniform)
    s0 = uniform["global"]["stages"][0]
    assert s0["bubble_schedule_ratio"] == pytest.approx(0.2)
    assert s0["bubble_imbalance_ratio"] == pytest.approx(0.0, abs=1e-9)
    assert s0["bubble_wait_ratio"] == pytest.approx(0.05)  # measured 0.25: the rest is waiting
    slow = {"global": {"stages": [stage(0, 0.4, 0.04, 0.08), stage(1, 0.2, 0.08, 0.08)]}}
    splitter.add_causes(slow)
    fast_stage = slow["global"]["stages"][0]
    assert fast_stage["bubble_imbalance_ratio"] > 0.1  # stage 0 waits for the slow stage 1
    parts = sum(fast_stage[k] for k in ("bubble_schedule_ratio", "bubble_imbalance_ratio", "bubble_wait_ratio"))
    assert parts == pytest.approx(0.4)


def test_a_partial_view_or_no_order_is_left_alone():
    splitter = CauseSplitter()
    summary = {"global": {"stages": [stage(0, 0.3, 0.04, 0.08)]}}
    splitter.add_causes(summary)  # no order announced
    assert "bubble_schedule_ratio" not in summary["global"]["stages"][0]
    splitter.set_order(pipeline_order("gpipe", 2, 4))
    splitter.add_causes(summary)  # stage 1 missing this step
    assert "bubble_schedule_ratio" not in summary["global"]["stages"][0]
    splitter.add_causes({"global": None})


def test_an_order_that_does_not_replay_is_counted_not_raised():
    splitter = CauseSplitter()
    assert splitter.set_order({0: ["0F0"], 1: ["1B0"]}) is None  # 1B0 waits for 1F0, which never runs
    assert splitter.errors == 1 and splitter.order is None
