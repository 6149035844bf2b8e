"""Live activity: what this rank is doing right now, posted to its node's sidecar about once a second.

A hang stops the training thread, and with it every step summary: whatever names the culprit
must come from another thread. This reporter runs on its own daemon thread and reads the
trainer's `registry.current` (the innermost open span, one attribute store per span on the
training thread; nothing else is asked of it): kind, op, group, peer and the collective's
per-group `seq`, since when (wall clock), plus pid, host, coordinates and the last completed
step. The sidecar's hang detector lines these up across ranks (parwatch.sidecar.hang).

Payload (POST /v1/activity, ~300 bytes): parwatch.wire.activity.ActivityPost, the record the sidecar decodes.
On close a last report says `state: "done"` (or "crashed", with the exception), so a rank that finished
is not taken for one that crashed when its pid disappears.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from typing import TextIO

from parwatch.collector.evidence import flight_recorder, open_chain, python_stacks, span_rows
from parwatch.thread_names import daemon_thread
from parwatch.vocabulary import RankState, SpanKind
from parwatch.wire.activity import BUSY_KINDS, MAX_PEERS_SENT, ActivityPost, ActivityReport, ReportState
from parwatch.wire.bounds import CONTROL_CHARS, MAX_ERROR_CHARS, MAX_TIME
from parwatch.wire.codec import encode
from parwatch.wire.evidence import EvidencePost, RankEvidence

log = logging.getLogger("parwatch.collector")

BUSY_END_POLL_SECONDS = 0.05
"""While a report said busy: how often the reporter looks whether the long activity has ended (then reports)."""


def describe_error(error: BaseException) -> str:
    """'ExceptionType: first line of the message', at most MAX_ERROR_CHARS (what the sidecar keeps)."""
    text = str(error).strip().splitlines()
    return re.sub(CONTROL_CHARS, " ", f"{type(error).__name__}: {text[0] if text else ''}")[:MAX_ERROR_CHARS]


class ActivityReporter:
    """One daemon thread per rank: sample `registry.current`, POST it to `endpoint`/v1/activity.

    summary_fn: returns the collector's latest step summary (a StepSummary) or None. time_fn: wall
    clock. http: an httpx.Client-like object (tests).
    """

    def __init__(
        self,
        ctx,
        registry,
        endpoint: str | None,
        token: str | None = None,
        interval_s: float = 1.0,
        http=None,
        time_fn=time.time,
        summary_fn=None,
        pid: int | None = None,
        perf_ns=time.perf_counter_ns,
        max_backoff_s: float = 5.0,
        stacks_path: str | None = None,
        on_abort=os._exit,
        spans_fn=None,
        device_fn=None,
        evidence_dir: str | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"ActivityReporter interval_s={interval_s!r} must be > 0 (1.0 suits most runs)")
        self.ctx = ctx
        self.registry = registry
        self.url = endpoint.rstrip("/") + "/v1/activity" if endpoint else None
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.interval_s = interval_s
        self._http, self._own_http = http, http is None
        self._time = time_fn
        self._perf_ns = perf_ns
        self._summary_fn = summary_fn or (lambda: None)
        self._pid = os.getpid() if pid is None else pid
        self._seen_span = None  # the span object last sampled and the wall time it was first seen
        self._seen_since = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set by report_soon() (and close()): the thread reports now, not at its next interval."""
        self._thread: threading.Thread | None = None
        self._backoff = 0.0
        self._retry_at = 0.0
        self._max_backoff_s = max_backoff_s
        self.stacks_path = stacks_path
        """faulthandler writes every thread's stack here on SIGUSR1 (the sidecar sends it on a hang); None:
        to stderr (registered whenever the reporter posts, so the signal never kills the rank)."""
        self._stacks_file: TextIO | None = None
        self._on_abort = on_abort
        self._spans_fn = spans_fn
        """() -> (this rank's recent closed spans, oldest first; mark -> wall seconds), for evidence."""
        self._device_fn = device_fn
        """() -> (span kind, since) while the CUDA device has stayed on one span's work, else None."""
        self.evidence_dir = evidence_dir
        """Where a Flight Recorder dump goes (the run directory); None: the temp directory."""
        self.evidence_given: set[int] = set()
        """Decisions this rank sent its evidence for (each once)."""
        self.sent = 0
        """Reports the sidecar accepted."""
        self.failed = 0
        """Reports lost (sidecar away or refusing)."""
        self.cpu_ns = 0
        """The reporter thread's CPU time so far (time.thread_time_ns), as of its last report."""

    # -- sampling (reporter thread) ---------------------------------------------------------
    def snapshot(self, state: ReportState = RankState.RUNNING, error: str | None = None) -> ActivityReport:
        """This rank's activity now: only reads; safe from any thread."""
        ctx, now = self.ctx, self._time()
        span = self.registry.current  # one read: the training thread may replace it right after
        summary = self._summary_fn()
        attrs = span.attrs if span is not None else {}
        busy = _busy_span(span)
        device = self._device_fn() if self._device_fn is not None else None
        return ActivityReport(
            **ctx.placement,
            pid=self._pid,
            host=ctx.hostname,
            state=state,
            step=-1 if summary is None else summary.step,
            step_seconds=None if summary is None else summary.step_seconds,
            kind=str(span.kind) if span is not None else None,
            op=attrs.get("op"),
            group=attrs.get("group"),
            peer=attrs.get("peer"),
            seq=attrs.get("seq"),
            since=self._since(span, now) if span is not None else None,
            time=now,
            step_end=None if summary is None else summary.time,
            error=error,
            busy=str(busy.kind) if busy is not None else None,  # type: ignore[arg-type]  # a BUSY_KINDS member
            busy_since=self._start_wall(busy, now) if busy is not None else None,
            sent=self._sent(),
            device_since=device[1] if device else None,
            device_kind=device[0] if device else None,
        )

    def _sent(self) -> list | None:
        """[[peer, sends posted to it], ...] from the registry's numbering (posted sends take their number)."""
        sent = [
            (peer, n)
            for (kind, peer), n in list(self.registry.sequence.items())  # list(): one atomic copy of the dict
            if kind == SpanKind.SEND and isinstance(peer, int)
        ]
        return sent[:MAX_PEERS_SENT] if sent else None

    def _start_wall(self, span, now: float) -> float:
        """Wall time a span opened: host-clock marks exactly, CUDA marks by their recording time."""
        start = span.start
        ns = start if type(start) is int else getattr(start, "host_ns", None)
        return now - (self._perf_ns() - ns) * 1e-9 if isinstance(ns, int) else now

    def _since(self, span, now: float) -> float:
        """Wall time the span opened: exact for host-clock marks (perf_counter_ns integers); for
        other marks (CUDA events) the first time this thread saw the span (within interval_s)."""
        start = span.start
        if type(start) is int:
            return now - (self._perf_ns() - start) * 1e-9
        if span is not self._seen_span:
            self._seen_span, self._seen_since = span, now
        return self._seen_since

    # -- shipping ---------------------------------------------------------------------------
    def post(self, record: ActivityReport) -> bool:
        if not self.url:
            return False
        now = time.monotonic()
        if now < self._retry_at:
            self.failed += 1
            return False
        body = encode(ActivityPost(1, record))
        try:
            response = self._client().post(self.url, content=body, headers=self._headers)
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            reply = response.json()
        except Exception as exc:
            self.failed += 1
            if self._backoff == 0.0:
                log.warning("parwatch: activity reports to %s failing (%s); retrying with backoff", self.url, exc)
            self._backoff = min(self._max_backoff_s, self._backoff * 2 if self._backoff else self.interval_s)
            self._retry_at = time.monotonic() + self._backoff
            return False
        self._backoff = self._retry_at = 0.0
        self.sent += 1
        wanted = reply.get("evidence") if isinstance(reply, dict) else None
        if isinstance(wanted, dict) and isinstance(wanted.get("decision"), int):
            self.give_evidence(wanted["decision"])
        code = reply.get("abort") if isinstance(reply, dict) else None
        if code:  # the leader found a hang and aborts the run: a restart from a checkpoint beats waiting
            log.error("parwatch: the sidecar aborts this run for a hang; exiting with %s", code)
            self._on_abort(int(code))
        return True

    # -- evidence (the leader named a hang or a crash) ---------------------------------------------
    def evidence(self, decision: int) -> RankEvidence:
        """This rank's evidence for `decision`: stacks of every thread, last spans, activity, Flight Recorder."""
        now = self._time()
        closed, wall_of = self._spans_fn() if self._spans_fn is not None else ([], lambda mark: None)
        chain = open_chain(self.registry.current)

        def wall(mark):
            try:
                t = wall_of(mark)
            except Exception:
                return None
            return t if isinstance(t, float) and 0 <= t <= MAX_TIME else None

        return RankEvidence(
            run_id=self.ctx.run_id,
            decision=decision,
            rank=self.ctx.rank,
            time=now,
            activity=self.snapshot(),
            stacks=python_stacks(),
            spans=span_rows(closed, wall, chain),
            flight_recorder=flight_recorder(self.evidence_dir, self.ctx.rank, decision),
        )

    def give_evidence(self, decision: int) -> bool:
        """Send this rank's evidence for `decision` to its sidecar, once per decision."""
        if decision in self.evidence_given or not self.url:
            return False
        self.evidence_given.add(decision)
        try:
            body = encode(EvidencePost(1, self.evidence(decision)))
            response = self._client().post(
                self.url.removesuffix("/v1/activity") + "/v1/evidence", content=body, headers=self._headers
            )
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        except Exception as exc:
            log.warning("parwatch: evidence for decision %d not sent (%s)", decision, exc)
            return False
        return True

    def _client(self):
        if self._http is None:
            import httpx

            # trust_env=False: the sidecar is on this node; a proxy for the internet must not capture it.
            self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=0.5), trust_env=False)
        return self._http

    def _run(self) -> None:
        # The first report at once: its sidecar then knows (and watches) this rank's process from attach, and
        # a rank that dies in its first second is named gone, not "never seen" (a short run in CI did).
        while True:
            busy = False
            try:
                report = self.snapshot()
                busy = report.busy is not None
                self.post(report)
            except Exception as exc:  # never let a bad sample end the thread
                log.warning("parwatch: activity sample failed (%s)", exc)
            self.cpu_ns = time.thread_time_ns()  # parwatch's own cost; one int store, read by the collector
            self._wait_next(busy)
            if self._stop.is_set():
                return

    def _wait_next(self, busy: bool) -> None:
        """An interval, or less: after a report inside a declared long activity (a checkpoint save, an eval
        pass), its end is reported at once. The leader counts a stall from it; from the last busy report,
        sampled up to an interval earlier, a 1.5 s hiccup right after an eval was named a hang (seed 46)."""
        if not busy:
            self._wake.wait(self.interval_s)
        else:
            deadline = time.monotonic() + self.interval_s
            while _busy_span(self.registry.current) is not None:  # a read of one attribute a tick
                left = deadline - time.monotonic()
                if left <= 0 or self._wake.wait(min(left, BUSY_END_POLL_SECONDS)):
                    break
        self._wake.clear()

    def report_soon(self) -> None:
        """Report now (from the training thread, at a step boundary that ended a step longer than
        interval_s): the leader learns the stall is over at once, not up to an interval later, when a hang's
        line may have passed (a 1.5 s hiccup stretched to 2 s under load, its step ending 0.24 s before a
        2.75 s bound, was named a hang in the quick campaign)."""
        self._wake.set()

    def start(self) -> ActivityReporter:
        if self._stacks_file is None and (self.stacks_path or self.url):
            # Always when reporting: the sidecar may send SIGUSR1 for a dump, which must never kill the rank.
            self._register_stack_dump()
        if self.url and self._thread is None:
            self._client()  # build the HTTP client (and its TLS context) now, at attach time, not mid-run
            self._thread = daemon_thread(self._run, "parwatch-activity")
            self._thread.start()
        return self

    def _register_stack_dump(self) -> None:
        import faulthandler
        import signal

        try:
            if self.stacks_path:
                os.makedirs(os.path.dirname(os.path.abspath(self.stacks_path)), exist_ok=True)
                self._stacks_file = open(
                    self.stacks_path, "a"
                )  # open for the process's life: the handler writes its fd
            else:
                import sys

                self._stacks_file = sys.stderr  # no run directory: the rank's log gets the stacks
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True)
        except (OSError, AttributeError, ValueError) as exc:  # no SIGUSR1 (Windows), unwritable dir
            log.warning("parwatch: no stack dumps on SIGUSR1 (%s)", exc)

    def close(self, timeout: float = 1.0, error: BaseException | None = None) -> None:
        """Stop the thread and say how this rank ended: done (so its pid vanishing is not a crash), or
        crashed with `error`, the exception that ended training."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None
        self._retry_at = 0.0  # the last word is worth one try even after failures
        try:
            if error is None:
                self.post(self.snapshot(state=RankState.DONE))
            else:
                self.post(self.snapshot(state=RankState.CRASHED, error=describe_error(error)))
        except Exception:
            pass
        if self._own_http and self._http is not None:
            with contextlib.suppress(Exception):
                self._http.close()


def _busy_span(span):
    """The innermost open span of a declared long activity (a checkpoint save, an eval pass), or None."""
    while span is not None:
        if span.kind in BUSY_KINDS:
            return span
        span = getattr(span, "parent", None)
    return None
