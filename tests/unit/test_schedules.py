"""Pipeline schedules as data: structure, memory, and timing (replayed by parwatch.pipeline_sim)."""

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from parwatch import pipeline_sim as ps
from parwatch.trainer.schedules import (
    COMPUTE_OPS,
    RECV_OPS,
    SEND_OPS,
    Instr,
    build_schedule,
    message_of,
    peer_stage,
    pipeline_order,
    virtual_stage,
)

STAGES = (1, 2, 3, 4)
MICROBATCHES = (1, 2, 3, 4, 8)
PLAIN = [(name, p, m, 1) for name in ("gpipe", "1f1b") for p in STAGES for m in MICROBATCHES]
INTERLEAVED = [("interleaved", p, m, v) for p in STAGES if p >= 2 for m in MICROBATCHES if m % p == 0 for v in (2, 3)]
ALL = PLAIN + INTERLEAVED


def build_all(name, p, m, v=1):
    return [build_schedule(name, s, p, m, v) for s in range(p)]


def peak_inflight(instrs):
    """Most (microbatch, chunk) pairs whose forward has run and backward not yet."""
    live, peak = set(), 0
    for ins in instrs:
        if ins.op == "forward":
            live.add((ins.microbatch, ins.chunk))
            peak = max(peak, len(live))
        elif ins.op == "backward":
            live.discard((ins.microbatch, ins.chunk))
    return peak


def replay(name, p, m, v=1, fwd=1.0, bwd=2.0, p2p=0.0):
    return ps.simulate(pipeline_order(name, p, m, v), {"F": fwd, "B": bwd}, p2p_s=p2p)


def _ids(case):
    name, p, m, v = case
    return f"{name}-p{p}-m{m}-v{v}"


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_every_unit_of_work_runs_once_with_its_messages_around_it(case):
    name, p, m, v = case
    for s, instrs in enumerate(build_all(name, p, m, v)):
        compute = [i for i in instrs if i.op in COMPUTE_OPS]
        assert len(compute) == 2 * m * v
        pos = {(i.op, i.microbatch, i.chunk): n for n, i in enumerate(instrs)}
        assert len(pos) == len(instrs), "an instruction appears twice"
        for mb in range(m):
            for c in range(v):
                f, b = pos[("forward", mb, c)], pos[("backward", mb, c)]
                assert f < b
                vs = virtual_stage(s, c, p)
                first, last = vs == 0, vs == p * v - 1
                # recv/send exist exactly where a neighbouring virtual stage does.
                assert (("recv_act", mb, c) in pos) == (not first)
                assert (("send_grad", mb, c) in pos) == (not first)
                assert (("send_act", mb, c) in pos) == (not last)
                assert (("recv_grad", mb, c) in pos) == (not last)
                assert pos.get(("recv_act", mb, c), -1) < f < pos.get(("send_act", mb, c), len(instrs))
                assert pos.get(("recv_grad", mb, c), -1) < b < pos.get(("send_grad", mb, c), len(instrs))


@pytest.mark.parametrize("case", [c for c in PLAIN if c[0] == "1f1b"], ids=_ids)
def test_1f1b_receives_grad_just_before_backward_and_sends_act_just_after_forward(case):
    name, p, m, v = case
    for s, instrs in enumerate(build_all(name, p, m, v)):
        for n, ins in enumerate(instrs):
            if ins.op == "backward" and s < p - 1:
                assert instrs[n - 1] == Instr("recv_grad", ins.microbatch)
            if ins.op == "forward" and s < p - 1:
                assert instrs[n + 1] == Instr("send_act", ins.microbatch)


@pytest.mark.parametrize("case", PLAIN, ids=_ids)
def test_peak_inflight_microbatches(case):
    name, p, m, _ = case
    for s in range(p):
        peak = peak_inflight(build_schedule(name, s, p, m))
        if name == "gpipe":
            assert peak == m
        else:
            assert peak <= p - s
            assert peak == min(m, p - s)


@pytest.mark.parametrize("case", INTERLEAVED, ids=_ids)
def test_interleaved_peak_inflight_is_megatrons_warmup_plus_one(case):
    name, p, m, v = case
    for s in range(p):
        warmup = 2 * (p - s - 1) + (v - 1) * p
        assert peak_inflight(build_schedule(name, s, p, m, v)) == min(warmup + 1, m * v)


def test_peak_inflight_counts_chunks_separately():
    instrs = [Instr("forward", 0, 0), Instr("forward", 0, 1), Instr("backward", 0, 1), Instr("backward", 0, 0)]
    assert peak_inflight(instrs) == 2


@pytest.mark.parametrize("case", PLAIN, ids=_ids)
def test_simulated_bubble_matches_the_formula(case):
    name, p, m, _ = case
    result = replay(name, p, m)
    assert result.makespan == pytest.approx((m + p - 1) * 3.0)
    for s in range(p):
        assert result.busy[s] == pytest.approx(3.0 * m)
        assert result.idle[s] == pytest.approx(result.makespan - result.busy[s])
        assert result.bubble[s] == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("case", INTERLEAVED, ids=_ids)
def test_interleaved_bubble_shrinks_by_the_number_of_chunks(case):
    name, p, m, v = case
    result = replay(name, p, m, v, fwd=1.0 / v, bwd=2.0 / v)
    for s in range(p):
        assert result.busy[s] == pytest.approx(3.0 * m)
        assert result.bubble[s] == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_gpipe_pays_p2p_latency_once_per_hop_each_way(p, m):
    result = replay("gpipe", p, m, p2p=0.25)
    assert result.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.25)


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_each_pair_of_ranks_receives_in_the_order_it_sends(case):
    name, p, m, v = case
    sent, received = defaultdict(list), defaultdict(list)
    for s, instrs in enumerate(build_all(name, p, m, v)):
        for ins in instrs:
            if ins.op in SEND_OPS:
                msg = message_of(ins, s, p)
                sent[(s, msg.dst_vstage % p)].append(msg)
            elif ins.op in RECV_OPS:
                msg = message_of(ins, s, p)
                received[(msg.src_vstage % p, s)].append(msg)
    assert sent == received
    assert sum(len(msgs) for msgs in sent.values()) == 2 * m * (p * v - 1)


def test_interleaved_wraps_from_the_last_rank_to_rank_0_next_chunk():
    p = 4
    act_in = message_of(Instr("recv_act", 2, chunk=1), stage=0, num_stages=p)
    assert (act_in.src_vstage % p, act_in.src_vstage // p) == (p - 1, 0)
    grad_out = message_of(Instr("send_grad", 2, chunk=1), stage=0, num_stages=p)
    assert (grad_out.dst_vstage % p, grad_out.dst_vstage // p) == (p - 1, 0)
    assert message_of(Instr("send_act", 2, chunk=0), 3, p) == act_in
    assert peer_stage(Instr("recv_act", 2, chunk=1), 0, p) == p - 1
    assert peer_stage(Instr("send_grad", 2, chunk=1), 0, p) == p - 1
    assert peer_stage(Instr("send_act", 2, chunk=1), 0, p) == 1
    assert peer_stage(Instr("recv_grad", 2, chunk=0), 3, p) == 0


@pytest.mark.parametrize(
    "kwargs,setting",
    [
        (dict(name="zerobubble"), "schedule='zerobubble'"),
        (dict(microbatches=0), "microbatches=0"),
        (dict(stage=4), "stage=4"),
        (dict(stage=-1), "stage=-1"),
        (dict(num_stages=0, stage=0), "num_stages=0"),
        (dict(chunks=2), "chunks=2"),
        (dict(name="interleaved", chunks=1), "chunks=1"),
        (dict(name="interleaved", chunks=2, microbatches=6), "microbatches=6"),
        (dict(name="interleaved", chunks=2, num_stages=1, stage=0), "num_stages=1"),
    ],
)
def test_bad_arguments_name_the_setting(kwargs, setting):
    args = dict(name="1f1b", stage=0, num_stages=4, microbatches=8, chunks=1) | kwargs
    with pytest.raises(ValueError) as err:
        build_schedule(**args)
    assert setting in str(err.value)


def test_instr_rejects_unknown_op():
    with pytest.raises(ValueError, match="op='fwd'"):
        Instr("fwd", 0)


def test_importable_without_torch():
    code = "import sys; sys.modules['torch'] = None; import parwatch.trainer.schedules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
