"""parwatch.pipeline_sim: the replay reproduces the closed forms on torch's own action lists."""

from __future__ import annotations

import pytest

from parwatch import pipeline_sim as ps
from parwatch.bubble import theoretical
from parwatch.wire.steps import GlobalStage
from tests.bubble_replay import other_before_last, tail_seconds, timings_from_spans, with_tail
from tests.torch_orders import ALL_CLASSES, V_STYLE, torch_order


def test_every_schedule_class_is_covered():
    """The classes this suite replays are the ones the installed torch ships (and no fewer)."""
    import torch.distributed.pipelining as pipelining

    shipped = {n[len("Schedule") :] for n in pipelining.__all__ if n.startswith("Schedule")}
    assert shipped == set(ALL_CLASSES)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (2, 8)])
def test_gpipe_matches_closed_form(p, m):
    result = ps.simulate(torch_order("GPipe", p, m), {"F": 0.04, "B": 0.08})
    for rank in range(p):
        assert result.bubble[rank] == pytest.approx(theoretical("gpipe", p, m))
    assert result.makespan == pytest.approx((m + p - 1) * 0.12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_1f1b_matches_closed_form(p, m):
    # torch 2.13's Schedule1F1B.pipeline_order starts the last rank at microbatch 1: the replay
    # refuses it with a clear error, and the order `_step_microbatches` runs gives the formula.
    with pytest.raises(ValueError, match=rf"rank {p - 1}: {p - 1}B0 depends on {p - 1}F0"):
        ps.simulate(torch_order("1F1B", p, m), {"F": 1, "B": 2})
    result = ps.simulate(ps.single_stage_order("1f1b", p, m), {"F": 0.04, "B": 0.08})
    assert all(b == pytest.approx(theoretical("1f1b", p, m)) for b in result.bubble.values())
    # The torch IR agrees with the executed order on every other rank.
    executed = ps.single_stage_order("1f1b", p, m)
    ir = ps.normalize(torch_order("1F1B", p, m))
    assert all(ir[r] == executed[r] for r in range(p - 1))


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (2, 4, 3)])
def test_interleaved_matches_closed_form(name, p, m, v):
    result = ps.simulate(torch_order(name, p, m, v), {"F": 0.02, "B": 0.04})
    assert all(b == pytest.approx(theoretical("interleaved", p, m, v)) for b in result.bubble.values())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1_at_equal_times(p, m):
    """ZB-H1 (torch's InterleavedZeroBubble, one stage per rank): idle (p-1)(F+I-W) in time,
    a third of 1F1B's (p-1)(F+I+W) at F=I=W (Qi et al. 2024, table 1)."""
    t = 0.03
    zb = ps.simulate(torch_order("InterleavedZeroBubble", p, m), {"F": t, "I": t, "W": t})
    one_f_one_b = ps.simulate(ps.single_stage_order("1f1b", p, m), {"F": t, "B": 2 * t})
    for rank in range(p):
        assert zb.idle[rank] == pytest.approx((p - 1) * (t + t - t))
        assert zb.idle[rank] == pytest.approx(one_f_one_b.idle[rank] / 3)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (2, 8)])
def test_zbv_at_equal_times(p, m):
    """ZBV at F=I=W: no bubble in the steady state; what is left is the first forward's walk
    down the ranks, (p-1)F, which does not grow with m."""
    t = 0.02
    result = ps.simulate(torch_order("ZBVZeroBubble", p, m, 2), {"F": t, "I": t, "W": t})
    for rank in range(p):
        assert result.busy[rank] == pytest.approx(2 * m * 3 * t)  # two chunks, m microbatches, F + I + W
        assert result.idle[rank] == pytest.approx((p - 1) * t)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (2, 8)])
def test_dualpipev_matches_its_formula(p, m):
    """DualPipeV: idle (S/2-1)(F&B + B - 3W) for S = 2p stages (ECOSYSTEM.md). The runtime posts
    an OVERLAP_F_B block's sends after the whole block, and on one stream F&B = F + B."""
    f = i = w = 0.02
    b = i + w
    result = ps.simulate(torch_order("DualPipeV", p, m, 2), {"F": f, "I": i, "W": w, "B": b})
    for rank in range(p):
        assert result.busy[rank] == pytest.approx(2 * m * (f + b))
        assert result.idle[rank] == pytest.approx((2 * p / 2 - 1) * ((f + b) + b - 3 * w))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8)])
def test_dualpipev_theory_the_collector_gets_keeps_the_overlap_blocks(p, m):
    """The integration's order of a DualPipeV schedule, as run_start carries it (strings), replays
    to the formula above at equal action times: flattened, its OVERLAP_F_B blocks handed each
    result on early and the theory came out half of it (0.020 for 0.040 at p=2, m=8)."""
    from parwatch.collector.causes import CauseSplitter
    from parwatch.integrations.torch_pipelining import action_order
    from tests.torch_orders import torch_schedule

    order = action_order(torch_schedule("DualPipeV", p, m, 2))
    assert any(isinstance(a, ps.Overlap) for acts in order.values() for a in acts)
    wire = {rank: [str(a) for a in acts] for rank, acts in order.items()}  # as StepLoop.begin sends it
    f, b, w = 1.0, 2.0, 1.0  # bubble.EQUAL_ACTION_SECONDS: B = I + W
    idle, busy = (p - 1) * ((f + b) + b - 3 * w), 2 * m * (f + b)
    assert CauseSplitter().set_order(wire) == pytest.approx(idle / (idle + busy))
    assert ps.normalize(wire) == ps.normalize(torch_order("DualPipeV", p, m, 2))  # the same actions


def test_overlap_strings_read_back_as_blocks():
    block = ps.Overlap((ps.Action(0, "F", 1), ps.Action(0, "B", 0)))
    assert str(block) == "(0F1;0B0)OVERLAP_F_B"
    order = {0: ["0F0", str(block), "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    assert ps.blocks(order)[0] == [ps.Action(0, "F", 0), block, ps.Action(0, "B", 1)]
    assert ps.normalize(order)[0] == [ps.Action(0, "F", 0), *block, ps.Action(0, "B", 1)]
    # 0F1 ends at 2, but the block (0B0 waits for 1B0 until 3) hands it on at 4: 1F1 runs 4-5.
    assert ps.simulate(order, {"F": 1.0, "B": 1.0}).finish[ps.Action(1, "F", 1)] == (4.0, 5.0)
    flat = {r: [str(a) for a in acts] for r, acts in ps.normalize(order).items()}
    assert ps.simulate(flat, {"F": 1.0, "B": 1.0}).finish[ps.Action(1, "F", 1)] == (3.0, 4.0)


def test_overlap_block_publishes_at_its_end():
    # rank 0 runs 0F0 and 0F1 as one block: rank 1's 1F0 must wait for the block, not for 0F0.
    class Overlap:  # duck-typed like torch's _Action
        computation_type, stage_index, microbatch_index = "OVERLAP_F_B", -1, None
        sub_actions = ("0F0", "0F1")

    order = {0: [Overlap()], 1: ["1F0", "1F1"]}
    result = ps.simulate(order, {"F": 1.0})
    assert result.finish[ps.Action(1, "F", 0)] == (2.0, 3.0)


def test_unequal_times_give_more_than_theory():
    order = torch_order("GPipe", 2, 4)
    slow_last = ps.simulate(order, {(0, "F"): 0.04, (0, "B"): 0.08, (1, "F"): 0.06, (1, "B"): 0.12})
    assert slow_last.bubble[0] > theoretical("gpipe", 2, 4) + 0.05
    assert slow_last.bubble[1] < slow_last.bubble[0]


def test_p2p_latency_adds_idle():
    order = ps.single_stage_order("1f1b", 2, 4)
    base = ps.simulate(order, {"F": 0.04, "B": 0.08})
    with_p2p = ps.simulate(order, {"F": 0.04, "B": 0.08}, p2p_s=0.01)
    assert with_p2p.makespan > base.makespan
    assert all(with_p2p.busy[r] == pytest.approx(base.busy[r]) for r in (0, 1))


def test_host_time_is_idle_before_each_action():
    """The executor's host work delays each action on its rank and reads as idle, not busy."""
    order = ps.single_stage_order("gpipe", 2, 2)
    base = ps.simulate(order, {"F": 0.04, "B": 0.08})
    hosted = ps.simulate(order, {"F": 0.04, "B": 0.08}, host_s={0: 0.001, 1: 0.002})
    assert hosted.busy == pytest.approx(base.busy)
    # rank 0: 1 ms before each of its 4 actions; rank 1's first F also waits for rank 0's first
    assert hosted.finish[ps.Action(0, "F", 0)] == pytest.approx((0.001, 0.041))
    assert hosted.finish[ps.Action(1, "F", 0)] == pytest.approx((0.041, 0.081))
    assert hosted.makespan > base.makespan and all(hosted.bubble[r] > base.bubble[r] for r in (0, 1))
    assert ps.simulate(order, {"F": 0.04, "B": 0.08}, host_s=0.001).finish[ps.Action(0, "F", 1)][0] == pytest.approx(
        0.042
    )  # one figure for every rank
    with pytest.raises(ValueError, match=r"host_s\[5\]"):
        ps.simulate(order, {"F": 1}, host_s={5: 0.1})
    with pytest.raises(ValueError, match=r"host_s\[0\] = \[0.1\]: .* each of the rank's 4 blocks"):
        ps.simulate(order, {"F": 1}, host_s={0: [0.1]})


def test_host_time_per_block_delays_what_follows_it():
    """10 ms of host work before rank 0's second forward delays it and everything downstream by 10 ms;
    the same 10 ms spread evenly over the rank's four blocks delays the step by 7.5 ms (the last
    2.5 ms waits beside rank 1's backward)."""
    order = ps.single_stage_order("gpipe", 2, 2)  # rank 0: 0F0 0F1 0B0 0B1
    durations = {"F": 0.04, "B": 0.08}
    base = ps.simulate(order, durations)
    where = ps.simulate(order, durations, host_s={0: [0.0, 0.01, 0.0, 0.0]})
    spread = ps.simulate(order, durations, host_s={0: 0.0025})
    assert where.finish[ps.Action(0, "F", 0)] == pytest.approx((0.0, 0.04))
    assert where.finish[ps.Action(0, "F", 1)] == pytest.approx((0.05, 0.09))
    assert where.makespan == pytest.approx(base.makespan + 0.01)
    assert spread.finish[ps.Action(0, "F", 0)] == pytest.approx((0.0025, 0.0425))
    assert spread.makespan == pytest.approx(base.makespan + 0.0075)
    assert where.busy == pytest.approx(base.busy) == spread.busy


def test_a_measured_latency_delays_only_what_its_action_produced():
    order = ps.single_stage_order("gpipe", 2, 2)
    durations = {"F": 0.04, "B": 0.08}
    late = ps.simulate(order, durations, p2p_s=0.001, p2p_of={ps.Action(0, "F", 1): 0.02})
    assert late.finish[ps.Action(1, "F", 0)][0] == pytest.approx(0.041)  # p2p_s
    assert late.finish[ps.Action(1, "F", 1)][0] == pytest.approx(0.1)  # 0F1 ends at 0.08, + 20 ms
    with pytest.raises(ValueError, match=r"p2p_of\[5F0\]"):
        ps.simulate(order, durations, p2p_of={ps.Action(5, "F", 0): 0.01})


def test_per_action_durations_win():
    order = {0: ["0F0", "0F1"]}
    result = ps.simulate(order, {"F": 1.0, ps.Action(0, "F", 1): 3.0})
    assert result.makespan == pytest.approx(4.0)


def _record(rank, kind, start, end, **attrs):
    return {"rank": rank, "kind": kind, "start_s": start, "end_s": end, "attrs": attrs}


def test_timings_from_spans_separate_host_from_waiting():
    """Per-action times from the spans; host time before each executor block = from the block before
    (or the period start) to the block's last compute span, less compute, receive waits and other work."""
    order = {0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}
    spans = [
        _record(0, "data", 10.0, 10.5, microbatch=0, chunk=0),  # other work: not host
        _record(0, "forward", 11.0, 12.0, microbatch=0, chunk=0),  # 0.5 s host before it
        _record(0, "recv", 12.5, 16.0, microbatch=0, chunk=0, what="grad"),  # waiting: not host
        _record(0, "backward", 16.5, 18.5, microbatch=0, chunk=0),  # 1.0 s host before it in all
        _record(0, "optimizer", 18.5, 19.0),  # after the last compute span
        _record(1, "recv", 10.0, 12.25, microbatch=0, vstage=1, what="activation"),  # 0.25 s after 0F0
        _record(1, "recv", 10.0, 12.2, microbatch=0, vstage=1, what="activation"),  # (a second rank's, say)
        _record(1, "forward", 12.25, 13.0, microbatch=0, vstage=1),
        _record(1, "loss", 13.0, 13.5, microbatch=0, vstage=1),  # added to the forward
        _record(1, "backward", 13.5, 15.5, microbatch=0, vstage=1),
    ]
    durations, host, p2p, p2p_of = timings_from_spans(order, spans, {0: 10.0, 1: 10.0})
    assert durations == pytest.approx(
        {ps.Action(0, "F", 0): 1.0, ps.Action(0, "B", 0): 2.0, ps.Action(1, "F", 0): 1.25, ps.Action(1, "B", 0): 2.0}
    )
    assert host == {0: pytest.approx([0.5, 1.0]), 1: pytest.approx([0.0, 0.0])}
    assert p2p == pytest.approx(0.25)  # the median of 0.25, 0.2 (activations), 0.5 (1B0 ends at 15.5, its grad at 16)
    assert p2p_of == pytest.approx({ps.Action(0, "F", 0): 0.25, ps.Action(1, "B", 0): 0.5})  # the later receiver
    with pytest.raises(ValueError, match="no span for actions 1B0"):
        timings_from_spans(order, spans[:-1], {0: 10.0, 1: 10.0})
    with pytest.raises(ValueError, match="period_start lacks rank 1"):
        timings_from_spans(order, spans, {0: 10.0})


def test_the_replay_adds_each_ranks_step_end_as_idle():
    """After the pipeline's last compute (18.5 s, rank 0), rank 0 spends 0.5 s in the optimizer (other
    work) and ends its boundary at 19.5 s: 0.5 s tail; rank 1 ends at 20.0 s: 1.5 s. The replayed
    bubble is then idle over the whole period, as the collector counts it."""
    spans = [
        _record(0, "backward", 16.5, 18.5, microbatch=0, chunk=0),
        _record(0, "optimizer", 18.5, 19.0),
        _record(0, "boundary", 19.2, 19.5),
        _record(1, "backward", 13.5, 15.5, microbatch=0, vstage=1),
        _record(1, "boundary", 19.0, 20.0),
    ]
    tails = tail_seconds(spans)
    assert tails == pytest.approx({0: 0.5, 1: 1.5})
    replay = ps.simulate({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, {"F": 1.0, "B": 2.0})
    assert replay.makespan == pytest.approx(6.0) and replay.idle == pytest.approx({0: 3.0, 1: 3.0})
    assert with_tail(replay, tails).bubble == pytest.approx({0: 3.5 / 6.5, 1: 4.5 / 7.5})
    # Rank 1's period opened 1 s after rank 0's: the replay's first second is not in its period.
    assert with_tail(replay, tails, {0: 0.0, 1: 1.0}).bubble == pytest.approx({0: 3.5 / 6.5, 1: 3.5 / 6.5})


def test_other_work_before_the_pipelines_end_is_not_replayed_idle():
    """Rank 1 (the last stage) syncs its gradients from 16.0 to 16.5 s, before rank 0's last backward ends
    (18.5 s): the collector counts that half second as other, not idle; so does the replay."""
    spans = [
        _record(0, "backward", 16.5, 18.5, microbatch=0, chunk=0),
        _record(0, "boundary", 19.2, 19.5),
        _record(1, "backward", 13.5, 15.5, microbatch=0, vstage=1),
        _record(1, "dp_sync", 16.0, 16.5),
        _record(1, "boundary", 19.0, 20.0),
    ]
    other = other_before_last(spans, {0: 12.5, 1: 12.5})
    assert other == pytest.approx({0: 0.0, 1: 0.5})
    replay = ps.simulate({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, {"F": 1.0, "B": 2.0})
    tails = tail_seconds(spans)
    assert with_tail(replay, tails, None, other).bubble == pytest.approx({0: 4.0 / 7.0, 1: 4.0 / 7.0})


def test_accepted_action_forms_agree():
    as_strings = {0: ["0F0", "0B0"], 1: ["1F0", None, "1B0"]}
    as_tuples = {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    as_actions = {0: [ps.Action(0, "F", 0), ps.Action(0, "B", 0)], 1: [ps.Action(1, "F", 0), ps.Action(1, "B", 0)]}
    with_comms = {0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD"], 1: ["1RECV_F0", "1F0", "1B0"]}
    results = [ps.simulate(o, {"F": 1.0, "B": 2.0}) for o in (as_strings, as_tuples, as_actions, with_comms)]
    assert {r.makespan for r in results} == {6.0}


def test_overlap_f_b_runs_its_sub_actions():
    order = torch_order("DualPipeV", 2, 4, 2)
    overlaps = [
        a for acts in order.values() for a in acts if a is not None and a.computation_type.value == "OVERLAP_F_B"
    ]
    assert overlaps
    compute = sum(
        len(a.sub_actions) if a in overlaps else 1
        for acts in order.values()
        for a in acts
        if a is not None and a.is_compute_op
    )
    flat = ps.normalize(order)
    assert sum(len(a) for a in flat.values()) == compute
    first = overlaps[0]
    rank = next(r for r, acts in order.items() if first in acts)
    at = [
        i
        for i, a in enumerate(flat[rank])
        if a == ps.Action(first.sub_actions[0].stage_index, "F", first.sub_actions[0].microbatch_index)
    ][0]
    assert str(flat[rank][at + 1]) == str(first.sub_actions[1])  # sub-actions back to back, in order
    done = {}
    for acts in flat.values():
        for a in acts:
            done.setdefault((a.stage, a.microbatch), set()).add(a.type)
    # every (stage, microbatch) is forwarded and fully backwarded, fused or split
    assert all("F" in k and ("B" in k or {"I", "W"} <= k) for k in done.values())


def test_b_defaults_to_i_plus_w():
    order = {0: ["0F0", "0B0"]}
    assert ps.simulate(order, {"F": 1.0, "I": 0.5, "W": 0.25}).makespan == pytest.approx(1.75)


@pytest.mark.parametrize(
    "order,durations,match",
    [
        ({0: ["0F0", "0B0"], 1: ["1B0"]}, {"F": 1, "B": 1}, "1B0 depends on 1F0, which no rank runs"),
        ({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]}, {"F": 1, "B": 1}, "deadlocks"),
        ({0: ["0F0", "0F0"]}, {"F": 1}, "appears twice"),
        ({0: ["0F0", "0B0"]}, {"F": 1}, r"no duration for B on stage 0"),
        ({0: ["0X0"]}, {"F": 1}, None),  # unknown non-compute type: dropped
        ({0: ["zero"]}, {"F": 1}, "is not like '2F0'"),
        ({"a": ["0F0"]}, {"F": 1}, "must be a rank"),
        ({0: ["0F0"], 1: ["2F0"]}, {"F": 1}, r"virtual stages \[1\] appear on no rank"),
        ({0: ["0F0"]}, {"Q": 1}, r"durations\['Q'\]"),
    ],
)
def test_bad_input_is_named(order, durations, match):
    if match is None:
        assert ps.simulate(order, durations).makespan == 0.0
        return
    with pytest.raises(ValueError, match=match):
        ps.simulate(order, durations)


def test_bubble_causes_split():
    order = ps.single_stage_order("1f1b", 2, 4)
    times = {0: {"F": 0.04, "B": 0.08}, 1: {"F": 0.06, "B": 0.12}}
    sim = ps.simulate(order, {(0, "F"): 0.04, (0, "B"): 0.08, (1, "F"): 0.06, (1, "B"): 0.12})
    measured = {0: sim.bubble[0] + 0.03, 1: sim.bubble[1]}
    causes = ps.bubble_causes(order, times, measured)
    uniform = ps.simulate(order, {"F": 0.05, "B": 0.10}).bubble
    for rank in (0, 1):
        c = causes[rank]
        assert c.schedule == pytest.approx(uniform[rank]) == pytest.approx(theoretical("1f1b", 2, 4))
        assert c.schedule + c.imbalance + c.wait == pytest.approx(measured[rank])
    assert causes[0].imbalance > 0.05  # the fast stage waits for the slow one
    assert causes[0].wait == pytest.approx(0.03)
    assert causes[1].wait == pytest.approx(0.0, abs=1e-12)
    assert set(causes[0].as_dict()) == {"schedule", "imbalance", "wait"}


def test_bubble_causes_on_a_v_schedule_with_split_backward():
    order = torch_order("ZBVZeroBubble", 2, 4, 2)
    times = {r: {"F": 0.02, "I": 0.02, "W": 0.02} for r in (0, 1)}
    causes = ps.bubble_causes(order, times, {0: 0.1, 1: 0.1})
    assert causes[0].imbalance == pytest.approx(0.0, abs=1e-12)
    assert causes[0].schedule == pytest.approx(0.02 / (0.02 * 25))


def test_bubble_causes_bad_input():
    order = ps.single_stage_order("gpipe", 2, 2)
    with pytest.raises(ValueError, match=r"lacks stages \[1\]"):
        ps.bubble_causes(order, {0: {"F": 1, "B": 1}}, {0: 0.1})
    with pytest.raises(ValueError, match=r"stages \[5\] the order does not run"):
        ps.bubble_causes(order, {0: {"F": 1, "B": 1}, 1: {"F": 1, "B": 1}}, {5: 0.1})


def test_per_action_seconds_from_global_view_totals():
    order = torch_order("DualPipeV", 2, 4, 2)  # a rank runs F, B, I and W
    acts = ps.normalize(order)
    f, i, w = 0.02, 0.015, 0.01
    totals = {}
    for rank, actions in acts.items():
        n = {k: sum(1 for a in actions if a.type == k) for k in "FBIW"}
        totals[rank] = GlobalStage(
            stage=rank,
            forward_seconds=n["F"] * f - 0.001,
            loss_seconds=0.001 if rank == 0 else 0.0,
            backward_seconds=n["B"] * (i + w) + n["I"] * i,
            backward_weight_seconds=n["W"] * w,
            compute_seconds=1.0,
            idle_seconds=0.1,
            step_seconds=1.1,
            bubble_ratio=0.1,
        )
    means = ps.per_action_seconds(order, totals)
    for rank in acts:
        assert means[rank]["I"] == pytest.approx(i) and means[rank]["W"] == pytest.approx(w)
        assert means[rank]["B"] == pytest.approx(i + w)
    assert means[1]["F"] == pytest.approx(f - 0.001 / sum(1 for a in acts[1] if a.type == "F"))
    causes = ps.bubble_causes(order, means, {r: t.bubble_ratio for r, t in totals.items()})
    assert set(causes) == {0, 1}
    with pytest.raises(ValueError, match="lacks stage 1"):
        ps.per_action_seconds(order, {0: totals[0]})


@pytest.mark.parametrize(
    "name,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)]
)
def test_reference_trainer_order_replays_to_the_formula(name, p, m, v):
    """The bundled trainer announces its order at run_start in this module's notation."""
    from parwatch.trainer.schedules import pipeline_order

    result = ps.simulate(pipeline_order(name, p, m, v), {"F": 0.02, "B": 0.04})
    assert all(b == pytest.approx(theoretical(name, p, m, v)) for b in result.bubble.values())


def _recurrence_replay(order, durations: dict, p2p_s: float, host: dict) -> dict:
    """The replay from its definition, by recursion: a block starts when the rank's previous block
    ended plus its host time; an action when that and its dependencies are done (a dependency from
    another rank: when that rank's block holding it ended, plus p2p_s). Returns {Action: (start, end)}."""
    import functools

    blocks = ps._groups(order)
    where = {a: (r, k) for r, groups in blocks.items() for k, g in enumerate(groups) for a in g}
    n_stages = 1 + max(a.stage for a in where)
    bwd = {(a.stage, a.microbatch): a.type for a in where if a.type in ("B", "I")}

    @functools.cache
    def block_times(rank: int, k: int) -> dict:
        t = (block_end(rank, k - 1) if k else 0.0) + host.get(rank, 0.0)
        out = {}
        for action in blocks[rank][k]:
            ready = t
            for dep in ps._dependencies(action, bwd, n_stages):
                dep_rank, dep_k = where[dep]
                if dep_rank != rank:
                    ready = max(ready, block_end(dep_rank, dep_k) + p2p_s)
                else:
                    ready = max(ready, block_times(dep_rank, dep_k)[dep][1])
            t = ready + durations[action]
            out[action] = (ready, t)
        return out

    def block_end(rank: int, k: int) -> float:
        return max(end for _, end in block_times(rank, k).values())

    return {a: block_times(*where[a])[a] for a in where}


@pytest.mark.parametrize("name", ALL_CLASSES)
def test_compiled_replay_equals_the_recurrence_for_every_torch_schedule(name):
    import random

    rng = random.Random(7)
    for p, m, v in ((2, 4, 1), (4, 8, 2), (3, 6, 2)):
        if name in ("GPipe", "1F1B"):  # what their _step_microbatches runs (see single_stage_order)
            order = ps.single_stage_order(name.lower(), p, m)
        else:
            order = torch_order(name, p, m, 2 if name in V_STYLE else v)
        replay = ps.Replay(order)
        for _ in range(3):
            durations = {a: rng.uniform(0.001, 0.05) for acts in replay.ranks.values() for a in acts}
            host = {r: rng.uniform(0, 0.002) for r in replay.ranks}
            p2p = rng.choice([0.0, 0.003])
            got = replay.run(durations, p2p, host)
            want = _recurrence_replay(order, durations, p2p, host)
            assert got.finish.keys() == want.keys()
            for action, (start, end) in want.items():
                assert got.finish[action] == pytest.approx((start, end), abs=1e-12), (name, p, m, v, action)
            assert got.bubble == ps.simulate(order, durations, p2p, host).bubble
