"""A simulated trainer for the collector tests: fake clock, synthetic GPipe steps, the boundary protocol.

It drives collectors exactly as the contract's StepBoundary does: spans via
`registry.span`, then per step `fill_boundary` on every rank, `pending_directive`
on rank 0, the boundary all-reduce as a "boundary" span, the SUM of every rank's
slots, and `emit_boundary`. Each simulated rank has its own HookRegistry and
fake clock, so two ranks live in one process. The tests at the bottom check
the synthetic schedule itself, so the other tests can rely on it.
"""

from __future__ import annotations

from parwatch.collector import Collector, RunContext, attach
from parwatch.contract import HEADER_SLOTS, BoundaryInfo, HookRegistry, OutcomeReport, PerfCounterClock, SpanKind

SEND_S = 0.0005  # an isend's span: posting to completion
P2P_BYTES = 4096


class FakeClock(PerfCounterClock):
    """Marks are whatever `at()` last set (integer nanoseconds), like perf_counter_ns."""

    def __init__(self) -> None:
        self.now_ns = 0

    def at(self, t: float) -> None:
        self.now_ns = round(t * 1e9)

    def mark(self) -> int:
        return self.now_ns


def ctx_for(rank: int, *, tp=1, pp=2, dp=1, m=4, schedule="gpipe", chunks=1, hostname="simhost", local_gpu=None):
    return RunContext.for_rank(
        "sim-run",
        rank,
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=schedule,
        microbatches=m,
        chunks=chunks,
        tokens_per_step=2048,
        local_gpu=local_gpu,
        hostname=hostname,
    )


class SimRank:
    def __init__(self, ctx: RunContext, clock=None, **collector_kwargs) -> None:
        self.ctx = ctx
        self.clock = clock if clock is not None else FakeClock()
        self.registry = HookRegistry()
        collector_kwargs.setdefault("time_fn", lambda: 1_700_000_000.0)
        self.collector = attach(Collector(ctx, clock=self.clock, **collector_kwargs), self.registry)

    def span(self, kind: str, start: float, end: float, **attrs) -> None:
        self.clock.at(start)
        with self.registry.span(kind, **attrs):
            self.clock.at(end)

    def emit(self, spans) -> None:
        for kind, start, end, attrs in spans:
            self.span(kind, start, end, **attrs)


class SimRun:
    """Ranks that meet at step boundaries; `boundary()` plays the trainer's part."""

    def __init__(self, ranks: list[SimRank], *, overlapped: bool = False) -> None:
        self.ranks = ranks
        self.world = len(ranks)
        self.overlapped = overlapped
        """Call the observers' during_boundary inside the boundary span, as StepBoundary does when the
        trainer's all-reduce is asynchronous."""

    def boundary(
        self,
        step: int,
        kind: str,
        enter: dict | float,
        exit_t: float,
        loss: float = 2.5,
        on_collective=None,
        share_marks: bool = False,
        report: OutcomeReport | None = None,
    ):
        """One boundary: each rank enters at enter[rank] (or `enter`), all leave at exit_t.

        share_marks: info.start/end are the collective span's own marks (a trainer may do that).
        Returns the directive rank 0's observers handed over (and that every rank receives).
        """
        enter = enter if isinstance(enter, dict) else {r: enter for r in range(self.world)}
        rows = []
        for r, rank in enumerate(self.ranks):
            rank.clock.at(enter[r])
            row = [0.0] * rank.registry.boundary_slots
            rank.registry.fill_boundary(step, row)
            rows.append(row)
        directive = self.ranks[0].registry.pending_directive()
        summed = [sum(col) for col in zip(*rows)]
        nbytes = 8 * (HEADER_SLOTS + len(summed))
        marks = []
        for r, rank in enumerate(self.ranks):
            rank.clock.at(enter[r])
            start = rank.registry.mark()
            with rank.registry.span(
                SpanKind.BOUNDARY, op="all_reduce", group="world", bytes=nbytes, group_size=self.world
            ) as span:
                if self.overlapped:
                    rank.registry.during_boundary()
                rank.clock.at(exit_t)
            marks.append((span.start, span.end) if share_marks else (start, rank.registry.mark()))
        if on_collective is not None:
            on_collective()
        for r, rank in enumerate(self.ranks):
            info = BoundaryInfo(
                step=step,
                kind=kind,
                loss=loss,
                directive=directive,
                report=report or OutcomeReport(0, {}, {}, None, self.world),
                start=marks[r][0],
                end=marks[r][1],
                world_size=self.world,
            )
            rank.registry.emit_boundary(info, list(summed))
        return directive


def gpipe_step(t0, stage, *, p=2, m=4, tf=0.010, tb=0.020, topt=0.005, dp_sync=0.0, tp_allreduce=0.0):
    """One stage's spans of a GPipe step starting at t0 with zero-latency p2p.

    Returns (spans, boundary_enter_time). Stage s forwards microbatch i at (s+i)*tf and the
    backward wave starts once the last stage has forwarded everything, so every stage idles
    (p-1)*(tf+tb): the schedule's bubble. Optional nested collectives: a TP all_reduce inside
    each forward, a DP all_reduce inside a dp_sync span after the backwards.
    """
    spans = []
    prev_end = t0
    pp = {"op": None, "group": "pp", "bytes": P2P_BYTES, "group_size": 2}
    for i in range(m):
        fs = t0 + (stage + i) * tf
        if stage > 0:
            spans.append(("recv", prev_end, fs, {**pp, "op": "recv", "what": "activation", "microbatch": i}))
        if tp_allreduce:
            spans.append(
                (
                    "collective",
                    fs + tf - tp_allreduce,
                    fs + tf,
                    {"op": "all_reduce", "group": "tp", "bytes": 1024, "group_size": 2},
                )
            )
        spans.append(("forward", fs, fs + tf, {"stage": stage, "microbatch": i, "chunk": 0}))
        if stage < p - 1:
            spans.append(
                ("send", fs + tf, fs + tf + SEND_S, {**pp, "op": "send", "what": "activation", "microbatch": i})
            )
        prev_end = fs + tf
    for i in range(m):
        bs = t0 + (m + p - 1) * tf + (p - 1 - stage + i) * tb
        if stage < p - 1:
            spans.append(("recv", prev_end, bs, {**pp, "op": "recv", "what": "grad", "microbatch": i}))
        spans.append(("backward", bs, bs + tb, {"stage": stage, "microbatch": i, "chunk": 0}))
        if stage > 0:
            spans.append(("send", bs + tb, bs + tb + SEND_S, {**pp, "op": "send", "what": "grad", "microbatch": i}))
        prev_end = bs + tb
    if dp_sync:
        spans.append(
            (
                "collective",
                prev_end + dp_sync / 4,
                prev_end + dp_sync * 3 / 4,
                {"op": "all_reduce", "group": "dp", "bytes": 1 << 20, "group_size": 2},
            )
        )
        spans.append(("dp_sync", prev_end, prev_end + dp_sync, {"stage": stage}))
        prev_end += dp_sync
    spans.append(("optimizer", prev_end, prev_end + topt, {"stage": stage}))
    return spans, prev_end + topt


def pipeline(p=2, m=4, overlapped=False, **collector_kwargs) -> SimRun:
    return SimRun([SimRank(ctx_for(r, pp=p, m=m), **collector_kwargs) for r in range(p)], overlapped=overlapped)


def run_steps(
    run: SimRun, steps, t0: float, *, first_step: int = 1, loss=lambda step: 2.5, gap: float = 0.0, **step_kw
) -> float:
    """GPipe steps first_step.. on every rank, each closed by a "step" boundary; returns the last exit time.

    gap: host time between a boundary and the step's first span (data loading), idle on every stage.
    """
    p = run.world
    for step in range(first_step, first_step + steps):
        enter = {}
        for r, rank in enumerate(run.ranks):
            spans, enter[r] = gpipe_step(t0 + gap, rank.ctx.stage, p=p, m=rank.ctx.microbatches, **step_kw)
            rank.emit(spans)
        t0 = max(enter.values())
        run.boundary(step, "step", enter, t0, loss=loss(step))
    return t0


# --- the synthetic schedule itself ---------------------------------------------------------------
def test_gpipe_step_runs_2m_compute_spans_without_overlap_on_each_stage():
    for stage in range(3):
        spans, enter = gpipe_step(1.0, stage, p=3, m=5)
        compute = sorted((s, e) for kind, s, e, _ in spans if kind in ("forward", "backward"))
        assert len(compute) == 10
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(compute, compute[1:]))
        assert enter == max(e for _, _, e, _ in spans)


def test_gpipe_step_stage_0_finishes_last_after_the_whole_pipeline():
    p, m, tf, tb, topt = 3, 5, 0.01, 0.02, 0.005
    ends = [gpipe_step(0.0, s, p=p, m=m, tf=tf, tb=tb, topt=topt)[1] for s in range(p)]
    assert max(ends) == ends[0]
    assert abs(ends[0] - ((m + p - 1) * (tf + tb) + topt)) < 1e-12


def test_a_step_longer_than_the_activity_interval_asks_for_a_report_at_its_boundary():
    """The leader's hang clock hears at once that a long step (a stall) ended (ActivityReporter.report_soon;
    tests/unit/test_activity_reporter.py has why)."""
    run = pipeline()
    asked = []
    for rank in run.ranks:
        rank.collector.activity.report_soon = lambda r=rank.ctx.rank: asked.append(r)  # type: ignore[method-assign]
    t = run_steps(run, 3, 1.0)  # steps of tens of ms
    assert asked == []
    run_steps(run, 1, t, first_step=4, gap=1.5)  # a step held 1.5 s (a hiccup), longer than the 1 s interval
    assert sorted(asked) == [0, 1]
