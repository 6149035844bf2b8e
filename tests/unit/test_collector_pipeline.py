"""The collector driven through parwatch.contract by a simulated p=2, m=4 GPipe pipeline on 2 ranks."""

from __future__ import annotations

import json

import pytest
from msgspec import to_builtins
from test_collector_sim import P2P_BYTES, SEND_S, pipeline, run_steps

from parwatch.collector import SpanSampling
from parwatch.wire.steps import COLLECTIVE_BUCKETS, OutcomeRecord

TF, TB, TOPT = 0.010, 0.020, 0.005
STEP = 5 * (TF + TB) + TOPT  # (m+p-1)(tf+tb) + optimizer: 0.155 s


def started(**kw):
    run = pipeline(p=2, m=4, **kw)
    run.boundary(0, "start", 0.0, 0.1)
    return run


def ops(summary):
    return {(c.op, c.group): c for c in summary.collectives}


def test_uniform_gpipe_step_has_the_schedules_bubble_on_every_stage():
    run = started()
    run_steps(run, 3, 0.1)
    for rank in run.ranks:
        s = rank.collector.last_summary
        assert s.step == 3
        assert s.step_seconds == pytest.approx(STEP, abs=1e-9)
        assert s.compute_seconds == pytest.approx(4 * (TF + TB), abs=1e-9)
        assert s.other_seconds == pytest.approx(TOPT, abs=1e-9)
        assert s.idle_seconds == pytest.approx((2 - 1) * (TF + TB), abs=1e-9)
        # (p-1)/(m+p-1) = 1/5, measured and theoretical alike
        assert s.bubble_ratio == pytest.approx(0.2, abs=1e-9)
        assert s.bubble_theoretical_ratio == 0.2
        assert rank.collector.summaries == 3


def test_tp_collectives_count_as_compute_and_dp_sync_collectives_are_not_counted_twice():
    run = started()
    run_steps(run, 1, 0.1, tp_allreduce=0.002, dp_sync=0.008)
    s = run.ranks[0].collector.last_summary
    assert s.step_seconds == pytest.approx(STEP + 0.008, abs=1e-9)
    assert s.compute_seconds == pytest.approx(4 * (TF + TB), abs=1e-9)  # TP all-reduces inside forwards
    assert s.other_seconds == pytest.approx(TOPT + 0.008, abs=1e-9)  # dp_sync once, its all_reduce not again
    assert s.idle_seconds == pytest.approx(TF + TB, abs=1e-9)
    tp, dp = ops(s)[("all_reduce", "tp")], ops(s)[("all_reduce", "dp")]
    assert (tp.count, tp.bytes) == (4, 4096)
    assert tp.seconds == pytest.approx(0.008, abs=1e-9)
    assert (dp.count, dp.bytes) == (1, 1 << 20)
    assert dp.seconds == pytest.approx(0.004, abs=1e-9)


def test_p2p_and_boundary_collective_statistics():
    run = started()
    run_steps(run, 1, 0.1)
    stage0, stage1 = (rank.collector.last_summary for rank in run.ranks)
    send0, recv0 = ops(stage0)[("send", "pp")], ops(stage0)[("recv", "pp")]
    assert (send0.count, send0.bytes) == (4, 4 * P2P_BYTES)
    assert send0.seconds == pytest.approx(4 * SEND_S, abs=1e-9)
    # busbw factor 1 for p2p: busbw == algbw == bytes / seconds
    assert send0.algbw == pytest.approx(4 * P2P_BYTES / (4 * SEND_S), rel=1e-9)
    assert send0.busbw == pytest.approx(send0.algbw, rel=1e-12)
    # stage 0 waits for grads: the first for the pipeline to turn round (tf+tb), then none
    assert recv0.count == 4
    assert recv0.seconds == pytest.approx(TF + TB, abs=1e-9)
    bucket_of_wait = COLLECTIVE_BUCKETS.index(0.05)
    assert recv0.buckets[0] == 3  # the three zero-length waits are <= 10 us
    assert recv0.buckets[bucket_of_wait - 1] == 3 and recv0.buckets[bucket_of_wait] == 4
    assert recv0.buckets[-1] == 4 and len(recv0.buckets) == len(COLLECTIVE_BUCKETS) + 1
    # The boundary all-reduce is mostly the wait for the flush, not a transfer: no collective sample.
    assert ("all_reduce", "world") not in ops(stage0) and ("all_reduce", "world") not in ops(stage1)


def test_rank_0_global_view_describes_the_previous_step_from_every_ranks_slots():
    run = started()
    run_steps(run, 1, 0.1, loss=lambda step: 3.0 + step)
    assert run.ranks[0].collector.last_summary.global_ is None  # step 1: nothing finished before it
    run_steps(run, 1, 0.1 + STEP, first_step=2, loss=lambda step: 3.0 + step)
    g = run.ranks[0].collector.last_summary.global_
    assert g.step == 1 and g.loss == 4.0
    assert g.pipeline_skew_ratio == pytest.approx(1.0)
    assert [st.stage for st in g.stages] == [0, 1]
    for st in g.stages:
        assert st.step_seconds == pytest.approx(STEP, abs=1e-9)
        assert st.compute_seconds == pytest.approx(0.12, abs=1e-9)
        assert st.bubble_ratio == pytest.approx(0.2, abs=1e-9)
    assert run.ranks[1].collector.last_summary.global_ is None  # rank 0 only


def test_loss_and_summary_identity():
    run = started()
    run_steps(run, 2, 0.1, loss=lambda step: float("nan") if step == 2 else 1.5)
    s = run.ranks[1].collector.last_summary
    assert s.wire_loss == "nan"
    assert (s.rank, s.stage, s.tp_rank, s.dp_rank, s.run_id) == (1, 1, 0, 0, "sim-run")
    assert s.tokens == 2048 and s.time == 1_700_000_000.0
    assert s.overhead_seconds > 0
    json.dumps(to_builtins(s), allow_nan=False)


def shipped(run):
    """Capture what each rank hands to its shipper, in order."""
    out = [[] for _ in run.ranks]
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_summary = lambda s, delivery=None, view=None, r=r: out[r].append(s)
    return out


def directive(**kw):
    return {"run_id": "sim-run", "to_step": None, "skip_batches": 0, **kw}


def test_heartbeats_and_resume_produce_no_summary_and_reset_the_period_origin():
    run = started()
    sent = shipped(run)
    t = run_steps(run, 1, 0.1)
    run.ranks[0].collector.directives.put(directive(id=3, action="pause"))
    # step 2 ends with the pause directive: every rank receives it at this boundary
    run_steps(run, 1, t, first_step=2)
    assert run.ranks[1].collector.last_summary.paused is True
    assert [len(s) for s in sent] == [2, 2]  # never held back for an acknowledgement
    for rank in run.ranks:
        rank.registry.emit_event("paused", step=2)
    t += STEP
    for i in range(5):  # paused: heartbeats repeat step 2, each with its boundary all-reduce
        run.boundary(2, "heartbeat", t + i, t + i + 0.5)
    # Rank 0 alone says "alive" for every rank: the sidecar refuses it from another rank's credential (403),
    # and a shipper refused for its credential drops what it holds (rank 1's last summaries were lost so).
    assert [r.collector.shipper.heartbeat_seen for r in run.ranks] == [True, False]
    run.ranks[0].collector.directives.put(directive(id=4, action="resume"))
    resume_end = t + 10.0
    assert run.boundary(2, "resume", t + 9.0, resume_end).id == 4
    assert [r.collector.summaries for r in run.ranks] == [2, 2]
    run_steps(run, 1, resume_end, first_step=3)
    for rank in run.ranks:
        s = rank.collector.last_summary
        assert s.step == 3 and s.paused is False
        assert s.step_seconds == pytest.approx(STEP, abs=1e-9)  # from the resume, not across the pause
        assert s.check is None
    assert [len(s) for s in sent] == [3, 3]
    assert run.ranks[0].collector.last_summary.global_ is None  # a resume starts the fast path over


def test_rank_0_reports_one_outcome_record_once_every_rank_handled_the_directive():
    from parwatch.contract import FailReason, Outcome, OutcomeReport

    run = started()
    outcomes = [[] for _ in run.ranks]
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_outcome = outcomes[r].append
    t = run_steps(run, 1, 0.1)
    half = OutcomeReport(7, {Outcome.APPLIED: 1}, {}, 12, 2)  # one rank of two has reported
    run.boundary(1, "resume", t, t + 0.1, report=half)
    assert outcomes == [[], []]
    done = OutcomeReport(7, {Outcome.SUBSTITUTED: 2}, {}, 12, 2)
    run.boundary(1, "heartbeat", t + 0.2, t + 0.3, report=done)
    run.boundary(1, "heartbeat", t + 0.4, t + 0.5, report=done)  # sticky: reported once only
    assert outcomes[1] == []  # rank 0 only
    assert outcomes[0] == [
        OutcomeRecord(
            directive_id=7,
            run_id="sim-run",
            outcome=Outcome.SUBSTITUTED,
            step=1,
            loaded_step=12,
            counts={Outcome.SUBSTITUTED: 2},
            reasons={},
            ranks=2,
        )
    ]
    failed = OutcomeReport(8, {Outcome.FAILED: 1, Outcome.APPLIED: 1}, {FailReason.CHECKPOINT_CORRUPT: 1}, None, 2)
    run.boundary(1, "heartbeat", t + 0.6, t + 0.7, report=failed)
    assert outcomes[0][-1].outcome == Outcome.MIXED
    assert outcomes[0][-1].reasons == {"checkpoint_corrupt": 1}


def test_a_rollback_starts_a_new_timeline():
    run = started()
    t = run_steps(run, 2, 0.1)
    assert run.ranks[1].collector.last_summary.timeline == 0
    for rank in run.ranks:
        rank.registry.emit_event("rollback", from_step=2, to_step=1, skip_batches=0)
    run.boundary(1, "resume", t, t + 0.1)
    run_steps(run, 1, t + 0.1, first_step=2)
    assert [r.collector.last_summary.timeline for r in run.ranks] == [1, 1]


def test_rollback_restarts_from_the_checkpoint_step():
    run = started()
    t = run_steps(run, 4, 0.1)
    for rank in run.ranks:
        rank.registry.emit_event("rollback", from_step=4, to_step=2, skip_batches=2)
    run.boundary(2, "resume", t + 1.0, t + 2.0)
    t = run_steps(run, 2, t + 2.0, first_step=3)
    s = run.ranks[0].collector.last_summary
    assert s.step == 4 and s.step_seconds == pytest.approx(STEP, abs=1e-9)
    assert s.global_.step == 3  # built from the replayed step 3, not the old step 3


def test_checkpoints_are_reported_by_rank_0_newest_20():
    run = started()
    for step in range(1, 26):
        for rank in run.ranks:
            rank.registry.emit_event("checkpoint_saved", step=step)
    run_steps(run, 25, 0.1)
    assert run.ranks[0].collector.last_summary.checkpoints == list(range(6, 26))
    assert run.ranks[1].collector.last_summary.checkpoints == []


def test_checkpoints_past_the_current_step_are_not_reported():
    """After a rollback the disk still holds the abandoned timeline's newer checkpoints."""
    run = started()
    for rank in run.ranks:
        rank.registry.emit_event("checkpoint_saved", step=1, checkpoints=[1, 8, 12])
    run_steps(run, 2, 0.1)
    assert run.ranks[0].collector.last_summary.checkpoints == [1]


def test_pending_directive_is_returned_once_per_id_and_only_on_rank_0():
    run = started()
    rank0, rank1 = (r.collector for r in run.ranks)
    raw = directive(id=9, action="rollback", to_step=40, skip_batches=8, reason="nonfinite-loss")
    rank0.directives.put(raw)
    rank1.directives.put(raw)
    d = rank0.pending_directive()
    assert (d.id, d.action, d.to_step, d.skip_batches, d.reason) == (9, "rollback", 40, 8, "nonfinite-loss")
    assert rank0.pending_directive() is None
    rank0.directives.put(raw)  # the sidecar repeats it until it has its outcome
    assert rank0.pending_directive() is None
    assert rank1.pending_directive() is None
    rank0.directives.put(directive(id=10, action="pause"))
    rank0.directives.put(None)  # cancelled: the sidecar's reply carries no directive any more
    assert rank0.pending_directive() is None
    rank0.directives.put(directive(id=11, action="pause"))
    assert rank0.pending_directive().id == 11


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"id": 0, "action": "pause"}, "id"),
        ({"id": 1, "action": "stop"}, "action"),
        ({"id": 1, "action": "pause"}, "run_id"),
        ({"id": 2**60, "action": "pause", "run_id": "r"}, "id"),
        ({"id": 1, "action": "rollback", "run_id": "r", "to_step": -3}, "to_step"),
        ({"id": 1, "action": "rollback", "run_id": "r", "skip_batches": -1}, "skip_batches"),
    ],
)
def test_malformed_directive_is_refused_naming_the_field(raw, field):
    run = started()
    with pytest.raises(ValueError, match=field):
        run.ranks[0].collector.directives.put(raw)
    assert run.ranks[0].collector.pending_directive() is None


def test_jsonl_files_hold_every_summary_and_the_sampled_steps_spans(tmp_path):
    run = started(
        log_path=str(tmp_path / "r{}" / "summaries.jsonl"),
        spans_path=str(tmp_path / "spans.jsonl"),
        span_sample_steps=SpanSampling(first=2, every=5),
    )
    run_steps(run, 6, 0.1)
    for rank in run.ranks:
        rank.collector.close(timeout=30)
    lines = [json.loads(line) for line in (tmp_path / "r{}" / "summaries.jsonl").read_text().splitlines()]
    assert sorted((s["rank"], s["step"]) for s in lines) == [(r, n) for r in (0, 1) for n in range(1, 7)]
    records = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {1, 2, 5}
    assert set(records[0]) == {"run_id", "rank", "stage", "step", "kind", "start_s", "end_s", "attrs"}
    # both ranks filled the start boundary at t=0: that is the origin; step 1 starts at 0.1
    first_forward = min(
        (r for r in records if r["kind"] == "forward" and r["rank"] == 0 and r["step"] == 1), key=lambda r: r["start_s"]
    )
    assert first_forward["start_s"] == pytest.approx(0.1, abs=1e-9)
    assert first_forward["end_s"] == pytest.approx(0.1 + TF, abs=1e-9)
    assert first_forward["attrs"] == {"stage": 0, "microbatch": 0, "chunk": 0}
    per_step = [r for r in records if r["step"] == 5 and r["rank"] == 1]
    assert sum(r["kind"] == "backward" for r in per_step) == 4


def test_a_straggling_step_keeps_its_spans_though_it_is_not_sampled(tmp_path):
    run = started(spans_path=str(tmp_path / "spans.jsonl"), span_sample_steps=SpanSampling(first=2, every=0))
    t = run_steps(run, 10, 0.1)
    t = run_steps(run, 1, t, first_step=11, tf=0.030)  # 3x slower forwards: a straggling step
    run_steps(run, 2, t, first_step=12)
    for rank in run.ranks:
        rank.collector.close(timeout=30)
    records = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {1, 2, 11}  # sampled 1-2; 11 kept for being slow
    slow = [r for r in records if r["step"] == 11 and r["rank"] == 0 and r["kind"] == "forward"]
    assert len(slow) == 4 and all(r["end_s"] - r["start_s"] == pytest.approx(0.030) for r in slow)


def test_attach_installs_the_clock_on_the_trainers_registry_and_close_restores_it(hook_registry):
    from test_collector_sim import FakeClock, ctx_for

    from parwatch.collector import Collector, attach
    from parwatch.contract import PerfCounterClock

    clock = FakeClock()
    collector = attach(Collector(ctx_for(0), clock=clock))
    assert hook_registry.observers == [collector] and hook_registry.clock is clock
    assert hook_registry.boundary_slots == collector.boundary_slots
    collector.close(timeout=5)
    assert hook_registry.observers == [] and isinstance(hook_registry.clock, PerfCounterClock)


def test_a_malformed_span_or_event_is_counted_not_raised():
    from parwatch.contract import Span

    run = started()
    collector = run.ranks[0].collector
    collector.on_span(Span("collective", None, None, {"op": "all_reduce"}))  # no marks
    collector.on_event("checkpoint_saved", {"checkpoints": ["x"]})  # not a step
    assert collector.errors == 1  # the event; spans are folded (and found malformed) at the step boundary
    run_steps(run, 1, 0.1)
    assert collector.errors == 2
    assert collector.last_summary.step_seconds == pytest.approx(STEP, abs=1e-9)


def test_folding_while_the_boundary_all_reduce_is_in_flight_changes_no_figure(tmp_path):
    """An asynchronous boundary all-reduce lets the collector fold the step's spans in during_boundary;
    every summary and span record must be what the synchronous boundary gives."""
    outputs = {}
    for overlapped in (False, True):
        out = tmp_path / str(overlapped)
        run = started(
            overlapped=overlapped,
            log_path=str(out / "summaries.jsonl"),
            spans_path=str(out / "spans.jsonl"),
            span_sample_steps=SpanSampling(first=2, every=0),
        )
        run_steps(run, 4, 0.1, tp_allreduce=0.002, dp_sync=0.008)
        for rank in run.ranks:
            rank.collector.close(timeout=30)
        records = []
        for name in ("summaries.jsonl", "spans.jsonl"):
            for line in (out / name).read_text().splitlines():
                record = json.loads(line)
                record.pop("overhead_seconds", None)  # the collector's own CPU time: differs run to run
                record.pop("self_seconds", None)  # parwatch's own time per part: differs run to run too
                record.pop("process_start_time", None)  # from the real monotonic clock, microseconds apart
                records.append(json.dumps(record, sort_keys=True))
        outputs[overlapped] = sorted(records)
    assert outputs[True] == outputs[False]
    assert sum('"bubble_ratio"' in r for r in outputs[True]) == 8  # 2 ranks x 4 steps
