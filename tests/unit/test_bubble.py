"""parwatch.bubble: the one stage bubble, its theory per schedule, the excess."""

from __future__ import annotations

import pytest

from parwatch import bubble
from parwatch import pipeline_sim as ps
from tests.torch_orders import torch_order


def test_stage_bubble_is_time_weighted_over_ranks():
    # Rank a: 0.2 s idle of 0.5 s pipeline time; rank b (long optimizer): 0.05 of 0.25.
    assert bubble.stage_bubble(0.2 + 0.05, 0.3 + 0.2) == pytest.approx(0.25 / 0.75)
    assert bubble.stage_bubble(0.2 + 0.05, 0.3 + 0.2) != pytest.approx((0.2 / 0.5 + 0.05 / 0.25) / 2)
    assert bubble.stage_bubble(0.0, 0.0) == 0.0  # no pipeline time, no bubble
    assert bubble.excess(0.35, 0.2) == pytest.approx(0.15)


def test_theory_closed_forms_and_errors():
    assert bubble.theoretical("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble.theoretical("1F1B", 2, 4) == pytest.approx(1 / 5)
    assert bubble.theoretical("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    # Looped BFS has the interleaved closed form (the replay agrees: test_pipeline_sim.py).
    assert bubble.theoretical("ScheduleLoopedBFS", 4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="no closed form for schedule 'zbv'"):
        bubble.theoretical("zbv", 2, 4, 2)
    with pytest.raises(ValueError, match="chunks=2 needs an interleaved schedule"):
        bubble.theoretical("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="microbatches=0 must be a positive integer"):
        bubble.theoretical("gpipe", 2, 0)


def test_replayed_theory_is_the_closed_form_where_there_is_one():
    assert bubble.replayed_theory(ps.Replay(ps.single_stage_order("1f1b", 4, 8))) == pytest.approx(
        bubble.theoretical("1f1b", 4, 8)
    )
    assert bubble.replayed_theory(ps.Replay(torch_order("Interleaved1F1B", 4, 8, 2))) == pytest.approx(
        bubble.theoretical("interleaved1f1b", 4, 8, 2)
    )


def test_promql_reads_the_catalogue_counters_per_stage():
    expr = bubble.promql("1m", ("job", "stage"))
    assert expr == (
        "sum by (job, stage) (rate(parwatch_stage_idle_seconds_total[1m])) / "
        "(sum by (job, stage) (rate(parwatch_stage_idle_seconds_total[1m])) + "
        "sum by (job, stage) (rate(parwatch_stage_compute_seconds_total[1m])) > 0)"
    )
    assert bubble.excess_promql("1m", ("job", "stage")) == (
        f"{expr} - on (job, stage) max by (job, stage) (parwatch_stage_bubble_theoretical_ratio)"
    )
