"""Per-step aggregation, collective statistics and the fast-path global view, from crafted inputs."""

from __future__ import annotations

import pytest

from parwatch.collector import RunContext
from parwatch.collector import global_view as gv
from parwatch.collector.stats import StepStats, breakdown
from parwatch.wire.steps import COLLECTIVE_BUCKETS


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
    assert entry.buckets == expected + [6]
    assert entry.count == 6 and entry.bytes == 6


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("broadcast", 4, 1.0),
    ],
)
def test_busbw_uses_the_nccl_tests_factor(op, n, factor):
    stats = StepStats()
    stats.add("collective", 0.002, {"op": op, "group": "world", "bytes": 1_000_000, "group_size": n})
    stats.add("collective", 0.002, {"op": op, "group": "world", "bytes": 3_000_000, "group_size": n})
    (entry,) = stats.collectives()
    assert entry.algbw == pytest.approx(4_000_000 / 0.004)
    assert entry.busbw == pytest.approx(4_000_000 / 0.004 * factor)


def test_send_recv_spans_default_to_the_pp_group_and_factor_1():
    stats = StepStats()
    stats.add("send", 0.001, {"op": "send", "bytes": 2048})
    stats.add("recv", 0.004, {"bytes": 2048})
    entries = {e.op: e for e in stats.collectives()}
    assert entries["send"].group == entries["recv"].group == "pp"
    assert entries["send"].busbw == pytest.approx(2048 / 0.001)
    assert entries["recv"].busbw == pytest.approx(2048 / 0.004)


def test_ops_outside_the_contract_are_skipped_and_counted():
    stats = StepStats()
    stats.add("collective", 0.001, {"op": "all_to_all", "group": "ep", "bytes": 8, "group_size": 4})
    stats.add("collective", 0.001, {"group": "tp"})
    assert stats.collectives() == [] and stats.skipped_ops == 2


def test_zero_duration_collective_reports_zero_bandwidth():
    stats = StepStats()
    stats.add("collective", 0.0, {"op": "all_reduce", "group": "tp", "bytes": 8, "group_size": 2})
    (entry,) = stats.collectives()
    assert entry.algbw == entry.busbw == 0.0 and entry.buckets[0] == 1


# --- fast path ----------------------------------------------------------------------------------
def contribute(summed, *, rank, stage, step, step_s, compute, other, idle, valid=True, by_kind=None):
    """Add one rank's slots into the summed vector, as the SUM all-reduce would."""
    slots = [0.0] * len(summed)
    previous = breakdown(step_s, compute, other) if valid else None
    gv.fill_slots(slots, rank=rank, stage=stage, previous=previous, previous_step=step, by_kind=by_kind)
    assert not valid or slots[gv.HEADER + stage * gv.STAGE_SLOTS + gv.IDLE] == pytest.approx(idle)
    for i, v in enumerate(slots):
        summed[i] += v


def test_slots_do_not_grow_with_tp_or_dp():
    assert gv.slots_for(4) == gv.HEADER + 4 * gv.STAGE_SLOTS
    ctx_small = RunContext.for_rank("r", 0, tp=1, pp=4, dp=1, schedule="1f1b", microbatches=4)
    ctx_big = RunContext.for_rank("r", 0, tp=8, pp=4, dp=512, schedule="1f1b", microbatches=4)
    from parwatch.collector import Collector

    assert Collector(ctx_small).boundary_slots == Collector(ctx_big).boundary_slots == gv.slots_for(4)


def test_global_view_means_per_stage_and_skew_over_stages():
    summed = [0.0] * gv.slots_for(2)
    contribute(
        summed,
        rank=0,
        stage=0,
        step=7,
        step_s=1.0,
        compute=0.1,
        other=0.1,
        idle=0.8,
        by_kind={"forward": 0.04, "backward": 0.06},
    )
    contribute(summed, rank=1, stage=1, step=7, step_s=1.0, compute=0.4, other=0.1, idle=0.5)
    contribute(
        summed,
        rank=2,
        stage=0,
        step=7,
        step_s=1.0,
        compute=0.3,
        other=0.1,
        idle=0.6,
        by_kind={"forward": 0.1, "backward": 0.2},
    )
    contribute(summed, rank=3, stage=1, step=7, step_s=1.0, compute=0.4, other=0.1, idle=0.5)
    g = gv.build_global_view(summed, 2, 2.25)
    assert g.step == 7 and g.loss == 2.25
    s0, s1 = g.stages
    assert (s0.stage, s0.compute_seconds, s0.idle_seconds) == (0, pytest.approx(0.2), pytest.approx(0.7))
    assert s0.bubble_ratio == pytest.approx(0.7 / 0.9) and s0.ranks == 2
    assert (s0.forward_seconds, s0.backward_seconds) == (pytest.approx(0.07), pytest.approx(0.13))
    assert s1.compute_seconds == pytest.approx(0.4)
    assert g.pipeline_skew_ratio == pytest.approx(0.4 / 0.3) and g.slowest_stage == 1


def test_global_view_leaves_out_ranks_without_a_finished_step():
    summed = [0.0] * gv.slots_for(2)
    contribute(summed, rank=0, stage=0, step=3, step_s=1.0, compute=0.5, other=0.0, idle=0.5)
    contribute(summed, rank=2, stage=1, step=3, step_s=1.0, compute=0.5, other=0.0, idle=0.5)
    contribute(summed, rank=3, stage=1, step=3, step_s=0, compute=0, other=0, idle=0, valid=False)
    g = gv.build_global_view(summed, 2, float("nan"))
    assert [s.compute_seconds for s in g.stages] == [0.5, 0.5]
    assert [s.ranks for s in g.stages] == [1, 1]
    assert g.wire_loss == "nan"
    nothing = [0.0] * gv.slots_for(2)
    contribute(nothing, rank=0, stage=0, step=3, step_s=0, compute=0, other=0, idle=0, valid=False)
    assert gv.build_global_view(nothing, 2, 1.0) is None


def test_no_compute_anywhere_is_no_skew():
    summed = [0.0] * gv.slots_for(2)
    contribute(summed, rank=0, stage=0, step=1, step_s=1.0, compute=0, other=0, idle=1.0)
    contribute(summed, rank=1, stage=1, step=1, step_s=1.0, compute=0, other=0, idle=1.0)
    assert gv.build_global_view(summed, 2, 1.0).pipeline_skew_ratio == 1.0


def test_origin_is_rank_0s_wall_clock_only():
    summed = [0.0] * gv.slots_for(2)
    for rank, stage in ((0, 0), (1, 1), (2, 0)):
        slots = [0.0] * len(summed)
        gv.fill_slots(slots, rank=rank, stage=stage, previous=None, previous_step=0, origin=100.0 + rank)
        summed = [a + b for a, b in zip(summed, slots)]
    assert gv.origin_of(summed) == 100.0
    assert gv.origin_of([0.0] * gv.slots_for(2)) is None


# --- RunContext ---------------------------------------------------------------------------------
def test_run_context_derives_coordinates_like_parallel_dims():
    from parwatch.trainer.parallel_dims import ParallelDims

    dims = ParallelDims(tp=2, pp=3, dp=2, world_size=12)
    for rank in range(12):
        ctx = RunContext.for_rank("r", rank, tp=2, pp=3, dp=2, schedule="interleaved", microbatches=6, chunks=2)
        assert (ctx.tp_rank, ctx.stage, ctx.dp_rank) == dims.coords(rank)
    assert ctx.bubble_theoretical_ratio == pytest.approx(2 / 14)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"world_size": 5}, "world_size=5"),
        ({"stage": 2}, "stage=2"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"schedule": "zb v"}, "schedule"),
        ({"chunks": 2}, "interleaved"),
        ({"microbatches": 0}, "microbatches"),
    ],
)
def test_run_context_refuses_inconsistent_settings_naming_them(change, message):
    base = dict(
        run_id="r",
        rank=0,
        world_size=4,
        tp=2,
        pp=2,
        dp=1,
        tp_rank=0,
        dp_rank=0,
        stage=0,
        schedule="gpipe",
        microbatches=4,
    )
    with pytest.raises(ValueError, match=message):
        RunContext(**{**base, **change})


def test_run_context_takes_any_rank_order_and_schedule_name():
    """Any order of tp, pp and dp, with coordinates that agree with it: e.g. PP fastest, then TP, and
    torch pipelining's schedule names; the same coordinates in the default order are refused, named."""
    fields = dict(
        run_id="r",
        rank=1,
        world_size=4,
        tp=2,
        pp=2,
        dp=1,
        tp_rank=0,
        dp_rank=0,
        stage=1,
        schedule="ZBVZeroBubble",
        microbatches=4,
        chunks=2,
    )
    ctx = RunContext(**fields, order="pp-tp-dp")
    assert (ctx.stage, ctx.tp_rank, ctx.order) == (1, 0, "pp-tp-dp")
    assert RunContext.for_rank("r", 1, tp=2, pp=2, dp=1, schedule="1f1b", microbatches=4, order="pp-tp").stage == 1
    with pytest.raises(ValueError, match="rank 1 says tp_rank 0, stage 1, dp_rank 0, but order 'tp-pp-dp'"):
        RunContext(**fields)
    with pytest.raises(ValueError, match="does not place tp"):
        RunContext(**fields, order="pp-dp")


def test_run_context_keeps_megatrons_order_in_canonical_form():
    """Megatron's default "tp-cp-ep-dp-pp" is "tp-dp-pp"; at dp = 1 it lays ranks out as the default does."""
    ctx = RunContext.for_rank("r", 1, tp=1, pp=2, dp=2, schedule="1f1b", microbatches=4, order="tp-cp-ep-dp-pp")
    assert (ctx.order, ctx.stage, ctx.dp_rank) == ("tp-dp-pp", 0, 1)
    ctx = RunContext.for_rank("r", 1, tp=1, pp=2, dp=1, schedule="1f1b", microbatches=4, order="tp-cp-ep-dp-pp")
    assert (ctx.order, ctx.stage) == ("tp-pp-dp", 1)
