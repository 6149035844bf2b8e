"""Per-step aggregation, collective statistics and the fast-path global view, from crafted inputs."""

from __future__ import annotations

import pytest

from parwatch.collector import RunContext
from parwatch.collector import global_view as gv
from parwatch.collector.stats import StepStats, breakdown
from parwatch.schema import COLLECTIVE_BUCKETS


def test_breakdown_follows_the_definitions():
    b = breakdown(step_seconds=2.0, compute_seconds=1.2, other_seconds=0.4)
    assert b.idle_seconds == pytest.approx(0.4)
    assert b.bubble_ratio == pytest.approx(0.4 / 1.6)
    assert breakdown(1.0, 0.0, 1.0).bubble_ratio == 0.0  # nothing but "other": no pipeline to idle in


def test_categories_ignore_collectives_and_unknown_kinds():
    stats = StepStats()
    stats.add("forward", 0.5, {})
    stats.add("backward", 1.0, {})
    stats.add("optimizer", 0.25, {})
    stats.add("dp_sync", 0.125, {})
    stats.add("collective", 0.1, {"op": "all_reduce", "group": "tp", "bytes": 10, "group_size": 2})
    stats.add("boundary", 3.0, {})
    assert (stats.compute_seconds, stats.other_seconds) == (1.5, 0.375)
    stats.reset()
    assert (stats.compute_seconds, stats.other_seconds, stats.collectives()) == (0.0, 0.0, [])


def test_histogram_buckets_are_cumulative_with_le_semantics():
    stats = StepStats()
    for seconds in (5e-6, 1e-5, 3e-4, 0.003, 0.003, 20.0):
        stats.add("collective", seconds, {"op": "all_gather", "group": "tp", "bytes": 1, "group_size": 4})
    (entry,) = stats.collectives()
    expected = []
    for bound in COLLECTIVE_BUCKETS:
        expected.append({1e-5: 2, 5e-5: 2, 1e-4: 2, 2.5e-4: 2, 5e-4: 3, 1e-3: 3, 2.5e-3: 3}.get(bound, 5))
    assert entry["buckets"] == expected + [6]
    assert entry["count"] == 6 and entry["bytes"] == 6


@pytest.mark.parametrize(
    "op, n, factor",
    [("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5),
     ("broadcast", 4, 1.0)],
)
def test_busbw_uses_the_nccl_tests_factor(op, n, factor):
    stats = StepStats()
    stats.add("collective", 0.002, {"op": op, "group": "world", "bytes": 1_000_000, "group_size": n})
    stats.add("collective", 0.002, {"op": op, "group": "world", "bytes": 3_000_000, "group_size": n})
    (entry,) = stats.collectives()
    assert entry["algbw"] == pytest.approx(4_000_000 / 0.004)
    assert entry["busbw"] == pytest.approx(4_000_000 / 0.004 * factor)


def test_send_recv_spans_default_to_the_pp_group_and_factor_1():
    stats = StepStats()
    stats.add("send", 0.001, {"op": "send", "bytes": 2048})
    stats.add("recv", 0.004, {"bytes": 2048})
    entries = {e["op"]: e for e in stats.collectives()}
    assert entries["send"]["group"] == entries["recv"]["group"] == "pp"
    assert entries["send"]["busbw"] == pytest.approx(2048 / 0.001)
    assert entries["recv"]["busbw"] == pytest.approx(2048 / 0.004)


def test_ops_outside_the_contract_are_skipped_and_counted():
    stats = StepStats()
    stats.add("collective", 0.001, {"op": "all_to_all", "group": "ep", "bytes": 8, "group_size": 4})
    stats.add("collective", 0.001, {"group": "tp"})
    assert stats.collectives() == [] and stats.skipped_ops == 2


def test_zero_duration_collective_reports_zero_bandwidth():
    stats = StepStats()
    stats.add("collective", 0.0, {"op": "all_reduce", "group": "tp", "bytes": 8, "group_size": 2})
    (entry,) = stats.collectives()
    assert entry["algbw"] == entry["busbw"] == 0.0 and entry["buckets"][0] == 1


# --- fast path ----------------------------------------------------------------------------------
def row(step, stage, step_s, compute, other, idle, valid=True):
    slots = [0.0] * gv.BOUNDARY_SLOTS
    previous = breakdown(step_s, compute, other) if valid else None
    gv.fill_slots(slots, previous=previous, previous_step=step, stage=stage, host=gv.host_key("h"))
    assert not valid or slots[gv.IDLE] == pytest.approx(idle)
    return slots


def test_global_view_means_per_stage_and_skew_over_stages():
    ctx = RunContext.for_rank("r", 0, tp=1, pp=2, dp=2, schedule="1f1b", microbatches=4)
    rows = [
        row(7, 0, 1.0, 0.1, 0.1, 0.8),  # rank 0: stage 0, replica 0
        row(7, 1, 1.0, 0.4, 0.1, 0.5),  # rank 1: stage 1
        row(7, 0, 1.0, 0.3, 0.1, 0.6),  # rank 2: stage 0, replica 1
        row(7, 1, 1.0, 0.4, 0.1, 0.5),  # rank 3: stage 1
    ]
    g = gv.build_global_view(rows, ctx.stage_of, 7, 2.25)
    assert g["step"] == 7 and g["loss"] == 2.25
    s0, s1 = g["stages"]
    assert (s0["stage"], s0["compute_seconds"], s0["idle_seconds"]) == (0, pytest.approx(0.2), pytest.approx(0.7))
    assert s0["bubble_ratio"] == pytest.approx(0.7 / 0.9)
    assert s1["compute_seconds"] == pytest.approx(0.4)
    assert g["pipeline_skew_ratio"] == pytest.approx(0.4 / 0.3)


def test_global_view_leaves_out_invalid_rows_and_rows_of_another_step():
    ctx = RunContext.for_rank("r", 0, tp=2, pp=2, dp=1, schedule="gpipe", microbatches=4)
    rows = [row(3, 0, 1.0, 0.5, 0.0, 0.5), row(2, 0, 9.0, 9.0, 0.0, 0.0), row(3, 1, 1.0, 0.5, 0.0, 0.5),
            row(3, 1, 0, 0, 0, 0, valid=False)]
    g = gv.build_global_view(rows, ctx.stage_of, 3, float("nan"))
    assert [s["compute_seconds"] for s in g["stages"]] == [0.5, 0.5]
    assert g["loss"] == "nan"
    assert gv.build_global_view([row(3, 0, 0, 0, 0, 0, valid=False)], ctx.stage_of, 3, 1.0) is None


def test_no_compute_anywhere_is_no_skew():
    ctx = RunContext.for_rank("r", 0, tp=1, pp=2, dp=1, schedule="gpipe", microbatches=4)
    g = gv.build_global_view([row(1, 0, 1.0, 0, 0, 1.0), row(1, 1, 1.0, 0, 0, 1.0)], ctx.stage_of, 1, 1.0)
    assert g["pipeline_skew_ratio"] == 1.0


def test_shared_origin_is_the_earliest_candidate_of_this_host():
    rows = [[0.0] * gv.BOUNDARY_SLOTS for _ in range(3)]
    gv.fill_slots(rows[0], previous=None, previous_step=0, stage=0, host=gv.host_key("a"), origin_candidate=5.0)
    gv.fill_slots(rows[1], previous=None, previous_step=0, stage=1, host=gv.host_key("a"), origin_candidate=4.5)
    gv.fill_slots(rows[2], previous=None, previous_step=0, stage=0, host=gv.host_key("b"), origin_candidate=1.0)
    assert gv.shared_origin(rows, gv.host_key("a")) == 4.5
    assert gv.shared_origin(rows, gv.host_key("c")) is None


# --- RunContext ---------------------------------------------------------------------------------
def test_run_context_derives_coordinates_like_parallel_dims():
    from trainer.parallel_dims import ParallelDims

    dims = ParallelDims(tp=2, pp=3, dp=2, world_size=12)
    for rank in range(12):
        ctx = RunContext.for_rank("r", rank, tp=2, pp=3, dp=2, schedule="interleaved", microbatches=6, chunks=2)
        c = dims.coords(rank)
        assert (ctx.tp_rank, ctx.stage, ctx.dp_rank) == (c.tp_rank, c.pp_rank, c.dp_rank)
        assert ctx.stage_of(rank) == c.pp_rank
    assert ctx.bubble_theoretical_ratio == pytest.approx(2 / 14)


@pytest.mark.parametrize(
    "change, message",
    [({"world_size": 5}, "world_size=5"), ({"stage": 1}, "for_rank"), ({"schedule": "zb"}, "schedule"),
     ({"chunks": 2}, "interleaved"), ({"microbatches": 0}, "microbatches")],
)
def test_run_context_refuses_inconsistent_settings_naming_them(change, message):
    base = dict(run_id="r", rank=0, world_size=4, tp=2, pp=2, dp=1, tp_rank=0, dp_rank=0, stage=0,
                schedule="gpipe", microbatches=4)
    with pytest.raises(ValueError, match=message):
        RunContext(**{**base, **change})
