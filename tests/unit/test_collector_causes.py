"""Rank 0's global view gets its bubble split into schedule, imbalance and wait (on the shipper's thread)."""

from __future__ import annotations

import pytest

from parwatch.collector.causes import CauseSplitter
from parwatch.trainer.schedules import pipeline_order
from parwatch.vocabulary import BubbleCause
from parwatch.wire.steps import GlobalStage, GlobalView


def stage(s, bubble, fwd, bwd):
    compute = fwd + bwd
    return GlobalStage(
        stage=s,
        compute_seconds=compute,
        idle_seconds=compute * bubble / (1 - bubble),
        step_seconds=compute / (1 - bubble),
        bubble_ratio=bubble,
        forward_seconds=fwd,
        backward_seconds=bwd,
    )


def view(*stages):
    return GlobalView(step=1, stages=list(stages))


def test_a_uniform_pipeline_has_only_the_schedules_bubble_and_a_slow_stage_adds_imbalance():
    splitter = CauseSplitter()
    theory = splitter.set_order(pipeline_order("1f1b", 2, 4))
    assert theory == pytest.approx(1 / 5)
    s0 = splitter.with_causes(view(stage(0, 0.25, 0.04, 0.08), stage(1, 0.25, 0.04, 0.08))).stages[0]
    assert s0.bubble_schedule_ratio == pytest.approx(0.2)
    assert s0.bubble_imbalance_ratio == pytest.approx(0.0, abs=1e-9)
    assert s0.bubble_wait_ratio == pytest.approx(0.05)  # measured 0.25: the rest is waiting
    fast_stage = splitter.with_causes(view(stage(0, 0.4, 0.04, 0.08), stage(1, 0.2, 0.08, 0.08))).stages[0]
    assert fast_stage.bubble_imbalance_ratio > 0.1  # stage 0 waits for the slow stage 1
    assert sum(getattr(fast_stage, c.ratio_field) for c in BubbleCause) == pytest.approx(0.4)


def test_a_partial_view_or_no_order_is_left_alone():
    splitter = CauseSplitter()
    partial = view(stage(0, 0.3, 0.04, 0.08))
    assert splitter.with_causes(partial) is partial  # no order announced
    splitter.set_order(pipeline_order("gpipe", 2, 4))
    assert splitter.with_causes(partial) is partial  # stage 1 missing this step
    assert partial.stages[0].bubble_schedule_ratio is None


def test_an_order_that_does_not_replay_is_counted_not_raised():
    splitter = CauseSplitter()
    assert splitter.set_order({0: ["0F0"], 1: ["1B0"]}) is None  # 1B0 waits for 1F0, which never runs
    assert splitter.errors == 1 and splitter.order is None
