"""The Collector: a parwatch.contract.Observer that turns one rank's spans into step summaries.

Everything here runs on the training thread and stays cheap: a span is only
appended to a list as it ends, and the step boundary folds the period's spans
into running sums in one loop (on CUDA, where marks are events, that is also
where they can be resolved, after the trainer's boundary collective has drained
the stream); a summary is built once per step and handed to the shipper's
bounded queue. The collector never blocks, never
issues a collective and never synchronises a device.

Step n's period on this rank runs from the end of the previous boundary of
kind start/step/resume to the end of boundary n. "heartbeat" boundaries (the
run is paused) and "resume" boundaries produce no summary; a resume (after a
pause or a rollback) starts a new period.

Directive outcomes need no per-rank message: every rank's outcome of the last
directive is counted in the boundary vector (parwatch.contract.boundary), so rank 0
alone reports one outcome record per directive to its sidecar, once every rank has
handled it. Summaries are never held back for that.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from msgspec.structs import replace

from parwatch import credentials
from parwatch.bubble import has_closed_form
from parwatch.collector import global_view as gv
from parwatch.collector.activity import ActivityReporter
from parwatch.collector.causes import CauseSplitter
from parwatch.collector.context import RunContext
from parwatch.collector.cuda_clock import default_clock, peak_memory_bytes
from parwatch.collector.device import DeviceProbe
from parwatch.collector.evidence import open_chain
from parwatch.collector.fallback import LocalGuard
from parwatch.collector.instances import InstanceLog
from parwatch.collector.ledger import Ledger, process_start_monotonic, shares_of
from parwatch.collector.nvml import NvmlSampler
from parwatch.collector.run_totals import RunTotals
from parwatch.collector.shipper import Delivery, Shipper
from parwatch.collector.stats import StepBreakdown, StepStats, breakdown
from parwatch.collector.wire import DirectiveInbox, check_record, outcome_record
from parwatch.contract import BoundaryInfo, BoundaryKind, Event, HookRegistry, Observer, Span
from parwatch.contract import registry as default_registry
from parwatch.tokens import read_token
from parwatch.vocabulary import Action, SelfPart, StepAction, StepFault, Triage, jsonable
from parwatch.wire.bounds import SCHEMA_VERSION
from parwatch.wire.evidence import MAX_EVIDENCE_SPANS
from parwatch.wire.steps import GlobalView, StepChecked, StepSummary

log = logging.getLogger("parwatch.collector")
_now_ns = time.perf_counter_ns

KEEP_CHECKPOINTS = 20


@dataclass(frozen=True)
class SpanSampling:
    """Which steps keep their full span list (spans.jsonl): the first steps, then every n-th."""

    first: int = 5
    """Steps 1..first are sampled; 0 samples none of the early steps."""
    every: int = 50
    """Every step divisible by this is sampled too; 0 means never after the first ones."""
    slow_factor: float = 1.5
    """A step longer than this times the recent mean step keeps its spans too, so a straggling step can
    be drawn (`parwatch report --step N`); 0 keeps none for being slow."""

    def __call__(self, step: int) -> bool:
        return 1 <= step <= self.first or (self.every > 0 and step > 0 and step % self.every == 0)


class Collector(Observer):
    """One rank's observer. Use `attach(Collector(ctx, ...))`, and `close()` at the end."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        log_path: str | None = None,
        spans_path: str | None = None,
        nvml=None,
        span_sample_steps=SpanSampling(),
        queue_size: int = 1024,
        http=None,
        clock=None,
        time_fn=time.time,
        memory_fn=None,
        nvml_interval_s: float = 0.25,
        poll_interval_s: float = 0.5,
        peak_flops: float | None = None,
    ) -> None:
        if token is None and endpoint:
            # $PARWATCH_RUN_KEY (a job script's, for torchrun's workers), else $PARWATCH_TOKEN.
            token = credentials.from_environment() or read_token(None)
        if token:
            # Only this rank's own credential is kept and sent: it speaks for this rank of this run alone.
            token = credentials.for_rank(token, ctx.run_id, ctx.rank)
        self.ctx = ctx
        self.boundary_slots = gv.slots_for(ctx.pp)
        self.clock = clock if clock is not None else default_clock(ctx)
        self._deferred = bool(getattr(self.clock, "resolves_at_boundary", False))
        self._sample = span_sample_steps or (lambda step: False)
        self._time_fn = time_fn
        self._memory_fn = memory_fn or (peak_memory_bytes if ctx.local_gpu is not None else (lambda: None))
        self.nvml = NvmlSampler(ctx.local_gpu, nvml=nvml, interval_s=nvml_interval_s).start()
        self.last_summary: StepSummary | None = None
        """The most recent summary, as built on the training thread (its bubble causes are added later); set
        before the activity reporter starts, whose first sample (at attach) reads it."""
        self.directives = DirectiveInbox()
        self.causes = CauseSplitter()
        """Rank 0: splits each global view's bubble into schedule, imbalance and wait (shipper thread)."""
        self._theory = ctx.bubble_theoretical_ratio
        self.shipper = Shipper(
            endpoint=endpoint,
            token=token,
            log_path=log_path,
            spans_path=spans_path,
            queue_size=queue_size,
            http=http,
            on_directive=self._on_directive,
            poll_interval_s=poll_interval_s if ctx.rank == 0 else None,
            prepare=self._prepare,
        ).start()
        self.activity = ActivityReporter(
            ctx,
            default_registry,
            endpoint,
            token,
            time_fn=time_fn,
            summary_fn=lambda: self.last_summary,
            stacks_path=os.path.join(os.path.dirname(log_path), f"stacks-rank{ctx.rank}.txt") if log_path else None,
            spans_fn=self._evidence_spans,
            device_fn=self._device_work if self._deferred else None,
            evidence_dir=os.path.dirname(log_path) if log_path else None,
        ).start()
        """Live activity for hang detection (its own thread; attach() points it at the registry)."""
        self.guard = (
            LocalGuard(
                ctx.run_id,
                time_fn,
                lambda: self.shipper.unreachable_since,
                os.path.dirname(log_path) if log_path else None,
            )
            if ctx.rank == 0 and endpoint
            else None
        )
        """Rank 0: pauses the run on a non-finite loss its sidecar (the leader) never saw (fallback.py)."""
        self.peak_flops = peak_flops or None
        """Device peak FLOP/s for MFU; None: unknown, no MFU in the summaries."""
        self._model_flops: float | None = None  # this rank's model FLOPs per step (run_start event)
        # Wall clock minus this clock's host seconds: span records are placed on rank 0's
        # wall-clock origin, so ranks of every host line up (as far as their clocks agree).
        mark = self.clock.mark()
        self._wall_offset = time_fn() - self._host_seconds(mark)
        self._release_marks([mark])
        self._stats = StepStats()
        self.ledger = Ledger(process_start_monotonic() or time.monotonic(), theory=ctx.bubble_theoretical_ratio)
        """Where every second of this rank's wall time went (the goodput ledger)."""
        self.process_start_time = time_fn() - (time.monotonic() - self.ledger.started_s)
        """This process's start, unix seconds: the sidecar tells a restart of the rank by it."""
        self._pid = os.getpid()
        """Sent beside it: the rank's sidecar proves the post's connection is this process's."""
        self._ledger_path = os.path.join(os.path.dirname(log_path), f"ledger-rank{ctx.rank}.json") if log_path else None
        self.instances = InstanceLog(ctx.hostname, seconds_of=self._host_seconds, duration_of=self.clock.seconds)
        """Per-instance collective/p2p records and data seconds for the sidecar's wait/transfer split."""
        self.totals = RunTotals(ctx.pp, ctx.microbatches, ctx.chunks)
        """Whole-run figures (rank 0) added to the trainer's summary at run_end."""
        self._pending: list[Span] = []  # this period's spans, folded at the boundary
        self.on_span = self._pending.append  # type: ignore[method-assign,assignment]  # the bound append is the hook
        """Every span is only appended here and folded into the step's figures at the boundary, in one
        loop. A span ends right after the training thread wakes (a sleep, a blocking receive), when the
        CPU's caches hold other work: there each Python call and object costs 5-10x its cost in a
        loop, so folding per span cost the training thread far more (docs/benchmarks.md). The list
        object is never replaced: the hook registry holds this bound method."""
        self._records: list | None = None  # span records of a sampled step; None when not sampling
        self._slow_factor = getattr(span_sample_steps, "slow_factor", 0.0) or 0.0
        self._folded: list[Span] = []  # this period's spans while not sampling: kept if the step is slow
        self._recent: list[Span] = []  # the last period's last spans: evidence when a hang is named
        self._device_probe = DeviceProbe()
        self._step_mean = 0.0  # exponential mean of the step periods (weight 0.1)
        self._steps_timed = 0
        self._step = 0  # the step the current period belongs to
        self._origin_mark = None  # end of the boundary that opened the current period
        self._time_origin_s: float | None = None  # the run's origin in this host's monotonic seconds
        self._previous: StepBreakdown | None = None
        self._previous_by_kind: dict = {}
        self._previous_step = -1
        self._previous_loss: float | None = None
        self._reported_id = 0  # rank 0: the last directive whose outcome went to the sidecar
        self._discard_at: int | None = None
        """Spans of this period before this index in _pending ran in a pass the check before the optimizer
        step discarded (a re-run's first pass, or all of a skipped step): their productive time is wasted."""
        self._discarded = 0.0  # productive seconds of the discarded spans folded this period
        self._check: dict | None = None  # this period's verdict of the check, when the step was bad
        self.timeline = 0
        """Rollbacks applied so far: (run_id, rank, timeline, step) names one summary."""
        self._checkpoints: list[int] = []
        self._paused = False
        self._overhead_ns = 0
        self._collector_ns = 0  # the sum of every summary's overhead: SelfPart.COLLECTOR
        self._registry: HookRegistry | None = None
        self.summaries = 0
        """Summaries produced so far."""
        self.unresolved_spans = 0
        """Deferred spans whose marks could not be resolved (dropped from the statistics)."""
        self.errors = 0
        """Spans or boundaries the collector could not handle (logged once, never raised)."""

    # --- hooks, training thread -------------------------------------------------------------
    # on_span is `self._pending.append` (set in __init__): see there.

    def fill_boundary(self, step: int, slots: list) -> None:
        t0 = _now_ns()
        valid = self._previous is not None and self._previous_step == step - 1
        origin = self._time_fn() if self._time_origin_s is None and self.ctx.rank == 0 else None
        gv.fill_slots(
            slots,
            rank=self.ctx.rank,
            stage=self.ctx.stage,
            previous=self._previous if valid else None,
            previous_step=self._previous_step,
            by_kind=self._previous_by_kind,
            origin=origin,
        )
        self._overhead_ns += _now_ns() - t0

    def directs(self) -> bool:
        return self.shipper.url is not None

    def pending_directive(self):
        if self.ctx.rank != 0:
            return None
        directive = self.directives.take()
        if directive is None and self.guard is not None:
            directive = self.guard.offer(self._checkpoints)
        return directive

    def settle(self, step: int, timeout_s: float) -> None:
        """Rank 0, after the run's last step: its summaries posted and answered, so that a directive on
        the last steps is pending at the settling boundary; a non-finite loss of the last step itself, which
        no view will carry to the leader, is the local guard's (a pause the leader then judges)."""
        if self.ctx.rank != 0:
            return
        flushed = self.shipper.flush(timeout_s)
        if self.guard is not None and self._previous_step == step:
            self.guard.never_judged(step)
        if not flushed and self.shipper.url:
            log.warning("parwatch: the sidecar did not answer the last steps' summaries within %.1f s", timeout_s)

    def _on_directive(self, raw) -> None:
        """Shipper thread: the sidecar's reply's directive, for the training thread to take."""
        self.directives.put(raw)
        latest = self.directives.latest
        if latest is not None and self.guard is not None:
            self.guard.saw(latest.id)

    def during_boundary(self) -> None:
        # Host clocks: fold the period's spans while the all-reduce is in flight (on_boundary
        # folds what is left: the boundary's own span). Deferred clocks resolve at on_boundary.
        if not self._deferred:
            t0 = _now_ns()
            self._fold_pending()
            self._overhead_ns += _now_ns() - t0

    def on_boundary(self, info: BoundaryInfo, slots: list) -> None:
        try:
            self._on_boundary(info, slots)
        except Exception as exc:  # lose a step's numbers, never the run
            self._count_error("boundary", exc)

    def _on_boundary(self, info: BoundaryInfo, slots: list) -> None:
        t0 = _now_ns()
        end = info.end if info.end is not None else self.clock.mark()
        done = self._resolve_pending(end) if self._deferred else self._fold_pending()  # marks to recycle
        if self._time_origin_s is None:
            origin = gv.origin_of(slots)
            self._time_origin_s = origin - self._wall_offset if origin is not None else self._host_seconds(end)
        if self.ctx.rank == 0:
            if info.directive is not None and self.guard is not None:
                self.guard.saw(info.directive.id, handled=True)
            self._report_outcome(info)
        kind = info.kind
        end_s = self._host_seconds(end)
        if kind == BoundaryKind.HEARTBEAT:  # paused: nothing is accounted until the resume
            self.ledger.gap(end_s, holding=True)
            if self.ctx.rank == 0:  # every rank joined it: rank 0's next poll vouches for them (only its may)
                self.shipper.heartbeat_seen = True
            self._begin_period(None, info.step, sample=False)
            done += (info.start, end)
        else:
            if kind == BoundaryKind.STEP and self._origin_mark is not None:
                self._finish_step(info, end, slots, t0)
                t0 = _now_ns()
            else:
                self.ledger.gap(end_s)
            if kind != BoundaryKind.STEP:  # start, resume (or a kind this collector does not know): a new origin
                self._previous = None
                self._paused = False
            done += (info.start, self._origin_mark)
            self._begin_period(end, info.step + 1, sample=True)
        if done:
            self._release(done)  # never the new origin: the trainer may reuse a span's mark as info.end
        self._overhead_ns += _now_ns() - t0

    def on_event(self, name: str, attrs: dict) -> None:
        t0 = _now_ns()
        try:
            self._on_event(name, attrs)
        except Exception as exc:
            self._count_error(f"event {name!r}", exc)
        self._overhead_ns += _now_ns() - t0

    def _on_event(self, name: str, attrs: dict) -> None:
        if name == Event.RUN_START:
            self._model_flops = attrs.get("model_flops_per_step")
            simulated = self.causes.set_order(attrs.get("pipeline_order"))
            if simulated is not None and not has_closed_form(self.ctx.schedule):
                self._theory = simulated  # zero-bubble and V schedules: the replay at equal action times
                self.ledger.theory = simulated
        elif name in (Event.CHECKPOINT_SAVED, Event.CHECKPOINT_CORRUPT) and self.ctx.rank == 0:
            # The trainer may pass the complete checkpoints on disk (pruned ones gone): prefer that list.
            listed = attrs.get("checkpoints")
            steps = [int(s) for s in listed] if listed is not None else self._checkpoints + [int(attrs["step"])]
            self._checkpoints = sorted(set(steps))[-KEEP_CHECKPOINTS:]
        elif name == Event.PAUSED:
            self._paused = True
            self.ledger.paused(time.monotonic())
        elif name == Event.RUN_END and self.ctx.rank == 0 and isinstance(attrs.get("summary"), dict):
            attrs["summary"].update(self.totals.as_dict(), time_seconds=self.ledger.snapshot())
        elif name == Event.ROLLBACK:
            if self.guard is not None:
                self.guard.rolled_back()
            self._previous = None
            self.timeline += 1
            self.ledger.rollback(int(attrs["to_step"]), time.monotonic())
        elif name == Event.RESTORED:
            self.ledger.loaded(time.monotonic())
        elif name == Event.STEP_RERUN:
            self._discard_at = len(self._pending)  # the first pass's spans: discarded
        elif name == Event.STEP_CHECKED:
            self._step_checked(attrs["verdict"])

    # --- internals ----------------------------------------------------------------------------
    def _step_checked(self, verdict: dict) -> None:
        """The check's verdict on a bad step: a skip discards all of the step's work; rank 0 has the leader
        record it (resent until accepted)."""
        self._check = verdict
        if not verdict["applied"]:
            self._discard_at = len(self._pending)
        if self.ctx.rank == 0:
            self.shipper.put_check(check_record(verdict, self.ctx.run_id, self.timeline, self._time_fn()))

    def _prepare(self, summary: StepSummary, view: GlobalView | None) -> StepSummary:
        """Shipper thread, before a summary is written or sent: the bubble's causes in rank 0's global
        view (another rank's own copy of the view, never sent), and this stage's shares of them for
        the ledger's next steps. Returns the summary to send."""
        if self.ctx.rank == 0:
            view = summary.global_
        if view is None:
            return summary
        view = self.causes.with_causes(view)
        for stage in view.stages:
            if stage.stage == self.ctx.stage:
                shares = shares_of(stage)
                if shares is not None:
                    self.ledger.split = shares
        return replace(summary, global_=view) if self.ctx.rank == 0 else summary

    def _self_seconds(self) -> dict[SelfPart, float]:
        """parwatch's own time on this rank so far, by part: plain ints each thread keeps for itself."""
        registry = self._registry if self._registry is not None else default_registry
        return {
            SelfPart.HOOKS: registry.hook_ns * 1e-9,
            SelfPart.COLLECTOR: self._collector_ns * 1e-9,
            SelfPart.SHIPPER: self.shipper.cpu_ns * 1e-9,
            SelfPart.ACTIVITY: self.activity.cpu_ns * 1e-9,
        }

    def _write_ledger(self) -> None:
        """The ledger as JSON next to the summaries (ledger-rank<N>.json), at close."""
        if self._ledger_path is None:
            return
        ended = self._time_fn()
        record = {
            "run_id": self.ctx.run_id,
            "rank": self.ctx.rank,
            "stage": self.ctx.stage,
            "process_start_time": self.process_start_time,
            "end_time": ended,
            **self.ledger.report(),
        }
        try:
            tmp = f"{self._ledger_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, self._ledger_path)
        except OSError as exc:
            log.warning("parwatch: could not write %s (%s)", self._ledger_path, exc)

    def _count_error(self, where: str, exc: Exception) -> None:
        if not self.errors:
            log.warning(
                "parwatch: collector %s error (%s: %s); counting further ones silently", where, type(exc).__name__, exc
            )
        self.errors += 1

    def _report_outcome(self, info: BoundaryInfo) -> None:
        """Rank 0: once every rank handled the last directive, one outcome record to the sidecar."""
        report = info.report
        if report.complete and report.directive_id > self._reported_id:
            self._reported_id = report.directive_id
            record = outcome_record(report, self.ctx.run_id, info.step)
            self.shipper.put_outcome(self.guard.annotate(record) if self.guard is not None else record)

    def _finish_step(self, info: BoundaryInfo, end, slots: list, t0: int) -> None:
        try:
            step_seconds = self.clock.seconds(self._origin_mark, end)
        except Exception as exc:  # an unresolvable mark: lose this step, not the run
            log.warning("parwatch: step %s not measured (%s)", info.step, exc)
            return
        stats = self._stats
        result = breakdown(step_seconds, stats.compute_seconds, stats.other_seconds)
        checked, self._check = self._check, None
        discarded, self._discarded = self._discarded, 0.0
        self.ledger.step(info.step, self._host_seconds(end), stats, result.idle_seconds, discarded)
        skipped = checked is not None and not checked["applied"]
        summary, own_view = self._summary(info, result, stats, slots, checked, t0)
        if self.guard is not None and not math.isfinite(info.loss) and not skipped:  # a skip kept the weights
            delivery = Delivery()  # did the leader get this loss? (LocalGuard)
            self.shipper.put_summary(summary, delivery, view=own_view)
            self.guard.loss(info.step, info.loss, delivery)
        else:
            self.shipper.put_summary(summary, view=own_view)
        if self._records is None and self._is_slow(step_seconds):
            self._records = self._records_of(self._folded, end)
        if self._records:
            origin = self._time_origin_s
            for record in self._records:
                record["start_s"] -= origin
                record["end_s"] -= origin
            self.shipper.put_spans(self._records)
        self.last_summary = summary
        self.summaries += 1
        if step_seconds > self.activity.interval_s:
            self.activity.report_soon()  # a long step (a stall) ended: the leader's hang clock hears of it now
        # A skipped step's loss never reached the weights: the view (what the rules judge) leaves it out.
        self._previous, self._previous_step = result, info.step
        self._previous_loss = None if skipped else info.loss
        self._previous_by_kind = stats.by_kind

    def _summary(
        self, info: BoundaryInfo, result: StepBreakdown, stats: StepStats, slots: list, checked: dict | None, t0: int
    ) -> tuple[StepSummary, GlobalView | None]:
        """This step's summary, and (on ranks but 0 that split their bubble) their own copy of the global view."""
        ctx = self.ctx
        global_view = own_view = None
        collectives = stats.collectives()
        if ctx.rank == 0:
            global_view = gv.build_global_view(slots, ctx.pp, self._previous_loss)
            if global_view is not None and global_view.step != self._previous_step:
                global_view = replace(global_view, wire_loss=None)  # the loss rank 0 holds is another step's
            self.totals.add_global(global_view)
            self.totals.add_collectives(collectives)
        elif self.causes.order is not None:
            own_view = gv.build_global_view(slots, ctx.pp, None)  # for the ledger's bubble split (_prepare)
        pausing = info.directive is not None and getattr(info.directive, "action", None) == Action.PAUSE
        step_seconds, flops, peak = result.step_seconds, self._model_flops, self.peak_flops
        mfu = flops / (step_seconds * peak) if flops and peak and step_seconds > 0 else None
        time_seconds, instances = self.ledger.snapshot(), self.instances.take()
        t1 = _now_ns()
        overhead_ns = self._overhead_ns + t1 - t0
        self._collector_ns += overhead_ns
        summary = StepSummary(
            **ctx.placement,
            v=SCHEMA_VERSION,
            microbatches=ctx.microbatches,
            chunks=ctx.chunks,
            schedule=ctx.schedule,
            step=info.step,
            timeline=self.timeline,
            time=self._time_fn(),
            step_seconds=step_seconds,
            compute_seconds=result.compute_seconds,
            other_seconds=result.other_seconds,
            idle_seconds=result.idle_seconds,
            bubble_ratio=result.bubble_ratio,
            bubble_theoretical_ratio=self._theory,
            wire_loss=None if info.loss is None else jsonable(float(info.loss)),
            tokens=ctx.tokens_per_step,
            memory_max_allocated_bytes=self._memory_fn(),
            collectives=collectives,
            gpu=self.nvml.take(),
            nvml_up=1 if self.nvml.up else 0,
            overhead_seconds=overhead_ns * 1e-9,
            self_seconds=self._self_seconds(),
            dropped_total=self.shipper.dropped,
            # Only this timeline's: after a rollback, checkpoints past the current step on disk
            # belong to the abandoned one and must not be rollback targets.
            checkpoints=[c for c in self._checkpoints if c <= info.step] if ctx.rank == 0 else [],
            paused=self._paused or pausing,
            global_=global_view,
            instances=instances,
            model_flops_utilization_ratio=mfu,
            time_seconds=time_seconds,
            process_start_time=self.process_start_time,
            check=None if checked is None else _checked(checked),
            pid=self._pid,
        )
        self._overhead_ns = _now_ns() - t1  # building the record counts with the next step's overhead
        return summary, own_view

    def _begin_period(self, origin_mark, step: int, *, sample: bool) -> None:
        if origin_mark is not None:
            self._origin_mark = origin_mark
            self._step = step
        self._stats.reset()
        self.instances.start(step if sample else 0)
        self._records = [] if sample and self._sample(step) else None
        self._folded = []

    def _resolve_pending(self, ref) -> list:
        """Deferred clocks: fold this period's spans now that their events have completed.

        Returns the marks that can be recycled once the boundary is handled."""
        clock, stats, records = self.clock, self._stats, self._records
        pending = self._pending.copy()
        self._pending.clear()
        self._recent = pending[-MAX_EVIDENCE_SPANS:]
        if records is None and self._slow_factor:
            self._folded += pending
        ref_host = self._host_seconds(ref) if records is not None else 0.0
        cut, self._discard_at = self._discard_at, None
        for i, span in enumerate(pending):
            if i == cut:  # the discarded pass is folded: what its productive time was
                self._discarded = stats.compute_seconds - stats.comm_in_compute_seconds
            try:
                seconds = clock.seconds(span.start, span.end)
                if records is not None:
                    start_s = ref_host - clock.seconds(span.start, ref)
                    records.append(self._record(span, start_s, start_s + seconds))
            except Exception:
                self.unresolved_spans += 1
                continue
            stats.add(span.kind, seconds, span.attrs, span.parent.kind if span.parent is not None else None)
            self.instances.add(span)
        if cut is not None and cut >= len(pending):
            self._discarded = stats.compute_seconds - stats.comm_in_compute_seconds
        return [mark for span in pending for mark in (span.start, span.end)]

    def _fold_pending(self) -> list:
        """Host clocks: fold this period's spans (what on_span once did per span). Returns no marks."""
        pending = self._pending.copy()
        self._pending.clear()
        self._recent = pending[-MAX_EVIDENCE_SPANS:]
        if self._discard_at is not None:  # the discarded pass first, then what its productive time was
            cut, self._discard_at = self._discard_at, None
            self._fold_host(pending[:cut])
            self._discarded = self._stats.compute_seconds - self._stats.comm_in_compute_seconds
            pending = pending[cut:]
        self._fold_host(pending)
        return []

    def _fold_host(self, pending: list[Span]) -> None:
        clock, stats, instances, records = self.clock, self._stats, self.instances, self._records
        host_seconds = self._host_seconds
        if records is None and self._slow_factor:
            self._folded += pending
        for span in pending:
            try:
                parent = span.parent
                stats.add(
                    span.kind,
                    clock.seconds(span.start, span.end),
                    span.attrs,
                    parent.kind if parent is not None else None,
                )
                instances.add(span)
                if records is not None:
                    records.append(self._record(span, host_seconds(span.start), host_seconds(span.end)))
            except Exception as exc:  # a malformed span must not stop training
                self._count_error("span", exc)

    def _is_slow(self, step_seconds: float) -> bool:
        """Whether this step is a straggler against the recent mean (after 5 steps); updates the mean."""
        slow = self._steps_timed >= 5 and step_seconds > self._slow_factor * self._step_mean > 0
        self._step_mean = step_seconds if not self._steps_timed else 0.9 * self._step_mean + 0.1 * step_seconds
        self._steps_timed += 1
        return slow and bool(self._slow_factor)

    def _records_of(self, spans: list[Span], ref) -> list:
        """Span records of a step that was not sampled, built at its boundary (marks still valid)."""
        out = []
        ref_host = self._host_seconds(ref)
        for span in spans:
            try:
                if self._deferred:
                    start_s = ref_host - self.clock.seconds(span.start, ref)
                    out.append(self._record(span, start_s, start_s + self.clock.seconds(span.start, span.end)))
                else:
                    out.append(self._record(span, self._host_seconds(span.start), self._host_seconds(span.end)))
            except Exception:  # an unresolvable mark: that span is left out
                continue
        return out

    def _release_marks(self, marks) -> None:
        release = getattr(self.clock, "release", None)
        if release is not None:
            release(marks)

    def _release(self, marks) -> None:
        release = getattr(self.clock, "release", None)
        if release is not None:
            origin = self._origin_mark
            release([m for m in marks if m is not None and m is not origin])

    def _record(self, span: Span, start_s: float, end_s: float) -> dict:
        ctx = self.ctx
        return {
            "run_id": ctx.run_id,
            "rank": ctx.rank,
            "stage": ctx.stage,
            "step": self._step,
            "kind": span.kind,
            "start_s": start_s,
            "end_s": end_s,
            "attrs": dict(span.attrs),
        }

    def _evidence_spans(self) -> tuple[list, Callable]:
        """Reporter thread: the last spans (the last period's tail, then this one's), and mark -> wall seconds."""
        spans = (self._recent + self._pending[:])[-MAX_EVIDENCE_SPANS:]  # slices: one atomic copy each
        return spans, lambda mark: self._host_seconds(mark) + self._wall_offset

    def _device_work(self) -> tuple[str, float] | None:
        """Reporter thread, CUDA clocks: the span whose work the device has stayed on (DeviceProbe), or None."""
        spans = [(str(s.kind), s.start, s.end, s.start.host_ns) for s in self._pending[:]]
        spans += [(str(s.kind), s.start, None, s.start.host_ns) for s in open_chain(self.activity.registry.current)]
        return self._device_probe.sample(spans, self._time_fn())

    def _host_seconds(self, mark) -> float:
        host_seconds = getattr(self.clock, "host_seconds", None)
        return host_seconds(mark) if host_seconds is not None else mark * 1e-9  # perf_counter_ns marks

    # --- lifecycle ----------------------------------------------------------------------------
    @property
    def dropped_total(self) -> int:
        return self.shipper.dropped

    @property
    def refused_total(self) -> int:
        """Of dropped_total: summaries the sidecar refused, for the token (HTTP 401/403) or as invalid."""
        return self.shipper.refused

    def close(self, timeout: float = 2.0, error: BaseException | None = None) -> None:
        """Detach from the hook registry, stop NVML, flush the queue (best effort) and stop the shipper;
        every thread joined. `error`: the exception that ended training, if one did (the sidecar then
        hears this rank crashed, and why, instead of done)."""
        from parwatch.collector.attach import detach  # attach imports this module

        detach(self)
        self.ledger.close(time.monotonic())
        self._write_ledger()
        self.activity.close(min(timeout, 1.0), error=error)
        self.nvml.close(min(timeout, 1.0))
        self.shipper.close(timeout)


def _checked(verdict: dict) -> StepChecked:
    """A summary's account of its bad step, from the check's verdict (Verdict.as_dict())."""
    return StepChecked(
        action=StepAction(verdict["action"]),
        fault=StepFault(verdict["fault"]),
        triage=Triage(verdict["triage"]),
        applied=verdict["applied"],
        ranks=verdict["ranks"][:64],
    )
