"""The sidecar's side of `--export`: when to take a point, and the workers that write it.

A point is due once every rank reporting here has reached the next multiple of `--export-every`: the
snapshot is then /metrics as it stands after that step (every rank's figures of it in), taken on the
event loop, which is the only place the store changes. Decisions (and hang findings, which are
decisions) are picked up every second too, so a hang, which stops the steps, still reaches the
trackers; when the run has ended here (every rank done, crashed or gone), or the sidecar stops, the
last step is written and the tracker run finished. Only a sidecar that judges the run (the leader, or
one alone) writes: a node sidecar never has a point due.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from functools import partial

from prometheus_client.core import CounterMetricFamily

from parwatch.catalog import family
from parwatch.guardrails.policy import RECENT_RECORDS
from parwatch.sidecar.trackers.series import Point, SeriesBuilder, Text, samples_of
from parwatch.sidecar.trackers.spec import DEFAULT_EVERY_STEPS, ExportSpec
from parwatch.sidecar.trackers.worker import Sink, TrackerWorker
from parwatch.vocabulary import RecordType, Tracker

log = logging.getLogger("parwatch.sidecar.trackers")

DECISIONS_TAG = "decisions"
STRAGGLER_TAG = "findings/straggler"


def make_sink(spec: ExportSpec, state_dir: str) -> Sink:
    """The writer of one --export value (its library imported only when it opens a run)."""
    if spec.tracker == Tracker.TENSORBOARD:
        from parwatch.sidecar.trackers.tb_sink import TensorBoardSink

        return TensorBoardSink(spec.target)
    if spec.tracker == Tracker.MLFLOW:
        from parwatch.sidecar.trackers.mlflow_sink import MlflowSink

        return MlflowSink(spec.target, spec.experiment)
    from parwatch.sidecar.trackers.wandb_sink import WandbSink

    return WandbSink(spec.experiment, state_dir)


class Exports:
    """Hooked into the Sidecar: `after_summary` on each ingested summary, `tick` every second, `close` at stop."""

    def __init__(self, sidecar, specs: Sequence[ExportSpec], every_steps: int = DEFAULT_EVERY_STEPS) -> None:
        self.sidecar = sidecar
        self.every = every_steps
        state_dir = str(sidecar.config.state_dir)
        self.workers = [TrackerWorker(spec, partial(make_sink, spec, state_dir)) for spec in specs]
        self.series = SeriesBuilder()
        self._run_id: str | None = None
        self._due = every_steps
        self._written_step: int | None = None  # the step of the last point of scalars
        self._last_decision = 0
        self._straggler_text = ""
        self._ended = False
        self._told_left_out: set[str] = set()
        sidecar.registry.register(_ExportFamilies(self.workers))

    # -- event loop ---------------------------------------------------------------------------
    def after_summary(self, step: int) -> None:
        """A summary of `step` was stored: write a point when every rank here has reached the due step."""
        if step < self._due and self.sidecar.store.run_id == self._run_id:
            return  # the common case: one comparison
        store = self.sidecar.store
        if store.run_id != self._run_id:
            self._begin(store.run_id)
        elif self._ended:
            if store.ended:  # a late summary of the ended run: its tracker runs are finished, not opened again
                return
            self._ended = False  # a restarted process goes on with the run: its tracker runs open again
        reached = min((rec.summary.step for rec in store.ranks.values()), default=0)
        if reached >= self._due and self.sidecar.rules_judged_by() is None:
            self._write(reached)
            self._due = reached - reached % self.every + self.every

    def tick(self) -> None:
        """Every second: new decisions, and the run's end."""
        store = self.sidecar.store
        if self._run_id is None or store.run_id != self._run_id or self.sidecar.rules_judged_by() is not None:
            return
        if store.ended:  # the run's end: its tracker runs finished once, and nothing after it opens them again
            if not self._ended:
                self._final()
            return
        texts = self._decision_texts()
        if texts:
            self._put(Point(self._run_id, self._text_step(texts), texts=tuple(texts)))

    def close(self, timeout: float = 10.0) -> None:
        """Sidecar stop: the last step written, every tracker run finished (each worker joined up to `timeout`)."""
        if self._run_id is not None and not self._ended and self.sidecar.rules_judged_by() is None:
            self._final()
        for worker in self.workers:
            worker.stop()  # all at once: each tracker finishes its run while the others do
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            if not worker.join(max(0.0, deadline - time.monotonic())):
                log.warning("--export %s: not finished within %.0f s at stop", worker.spec, timeout)

    # -- internals ------------------------------------------------------------------------------
    def _begin(self, run_id: str | None) -> None:
        if self._run_id is not None and not self._ended:
            self._final()  # another run took over: the old one's tracker run is finished
        self._run_id, self._due, self._written_step, self._ended = run_id, self.every, None, False
        self._last_decision, self._straggler_text = 0, ""
        self.series.reset()

    def _write(self, step: int, final: bool = False) -> None:
        assert self._run_id is not None
        scalars = self.series.scalars(samples_of(self.sidecar.registry.collect()))
        new = self.series.left_out - self._told_left_out
        if new:
            self._told_left_out |= new
            log.warning("--export: over %d series; left out %s", self.series.max_series, ", ".join(sorted(new)))
        texts = self._decision_texts() + self._straggler_texts(step)
        self._written_step = step
        self._put(Point(self._run_id, step, scalars, tuple(texts), final=final))

    def _final(self) -> None:
        self._ended = True
        store = self.sidecar.store
        reached = min((rec.summary.step for rec in store.ranks.values()), default=0)
        if self._run_id is not None and reached > (self._written_step or 0):
            self._write(reached, final=True)
        elif self._run_id is not None:
            texts = self._decision_texts()
            self._put(Point(self._run_id, self._text_step(texts), texts=tuple(texts), final=True))

    def _put(self, point: Point) -> None:
        for worker in self.workers:
            worker.put(point)

    def _decision_texts(self) -> list[Text]:
        """Decision records decided since the last point, as JSON, one text each (hang findings among them)."""
        engine = self.sidecar.engine
        if engine.run_id != self._run_id:
            return []
        out = []
        for record in engine.decisions(RECENT_RECORDS):
            if record.get("type") == RecordType.DECISION and record.get("id", 0) > self._last_decision:
                self._last_decision = record["id"]
                step = record.get("step")
                text = json.dumps(record, sort_keys=True, separators=(",", ":"))
                out.append(Text(DECISIONS_TAG, text, step if step is not None else self._written_step or 0))
        return out

    def _straggler_texts(self, step: int) -> list[Text]:
        """The straggler attribution's findings, when they changed since the last point ("none" once cleared)."""
        findings = self.sidecar.transfer.findings()
        text = "\n".join(f.text or f.key for f in findings) or ("none" if self._straggler_text else "")
        if text == self._straggler_text or not text:
            return []
        self._straggler_text = text if findings else ""
        return [Text(STRAGGLER_TAG, text, step)]

    def _text_step(self, texts: list[Text]) -> int:
        return max([t.step for t in texts] + [self._written_step or 0])


class _ExportFamilies:
    """parwatch_tracker_points_written_total / _dropped_total{tracker}, read from the workers' counts."""

    def __init__(self, workers: list[TrackerWorker]) -> None:
        self.workers = workers

    def collect(self):
        written = family(CounterMetricFamily, "parwatch_tracker_points_written_total")
        dropped = family(CounterMetricFamily, "parwatch_tracker_points_dropped_total")
        for worker in self.workers:
            written.add_metric([str(worker.spec.tracker)], worker.written)
            dropped.add_metric([str(worker.spec.tracker)], worker.dropped)
        yield from (written, dropped)
