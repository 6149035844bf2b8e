"""The wire objects the collector produces and consumes (their records: parwatch/step_records.py): the step
summary and the directive outcome record it sends, and the sidecar's directive it receives."""

from __future__ import annotations

import json
import logging
from collections import deque

import msgspec

from parwatch.collector.context import RunContext
from parwatch.collector.stats import StepBreakdown
from parwatch.contract import Directive, OutcomeReport
from parwatch.contract.directives import parse_directive
from parwatch.vocabulary import Outcome, jsonable
from parwatch.wire.bounds import SCHEMA_VERSION
from parwatch.wire.steps import OutcomeRecord, StepCheckRecord, StepSummary

log = logging.getLogger("parwatch.collector")


def build_summary(
    ctx: RunContext,
    *,
    step: int,
    time: float,
    result: StepBreakdown,
    loss: float | None,
    collectives: list,
    memory_max_allocated_bytes: int | None,
    gpu: dict | None,
    nvml_up: bool,
    dropped_total: int,
    checkpoints: list,
    paused: bool,
    global_view: dict | None,
    overhead_seconds: float = 0.0,
    timeline: int = 0,
    bubble_theoretical_ratio: float | None = None,
) -> dict:
    """One StepSummary, keys in the schema's order. `global` is None except on rank 0."""
    return {
        "v": SCHEMA_VERSION,
        "run_id": ctx.run_id,
        "rank": ctx.rank,
        "stage": ctx.stage,
        "tp_rank": ctx.tp_rank,
        "dp_rank": ctx.dp_rank,
        "tp": ctx.tp,
        "pp": ctx.pp,
        "dp": ctx.dp,
        "order": ctx.order,
        "microbatches": ctx.microbatches,
        "chunks": ctx.chunks,
        "schedule": ctx.schedule,
        "step": step,
        "timeline": timeline,
        "time": time,
        "step_seconds": result.step_seconds,
        "compute_seconds": result.compute_seconds,
        "other_seconds": result.other_seconds,
        "idle_seconds": result.idle_seconds,
        "bubble_ratio": result.bubble_ratio,
        "bubble_theoretical_ratio": ctx.bubble_theoretical_ratio
        if bubble_theoretical_ratio is None
        else bubble_theoretical_ratio,
        "loss": None if loss is None else jsonable(float(loss)),
        "tokens": ctx.tokens_per_step,
        "memory_max_allocated_bytes": memory_max_allocated_bytes,
        "collectives": collectives,
        "gpu": gpu,
        "nvml_up": 1 if nvml_up else 0,
        "overhead_seconds": overhead_seconds,
        "dropped_total": dropped_total,
        "checkpoints": checkpoints,
        "paused": paused,
        "global": global_view,
    }


def outcome_record(report: OutcomeReport, run_id: str, step: int) -> OutcomeRecord:
    """The ingest body's outcome record for a complete report (every rank handled the directive)."""
    outcome = report.outcome
    return OutcomeRecord(
        directive_id=report.directive_id,
        run_id=run_id,
        outcome=outcome if outcome is not None else Outcome.MIXED,
        step=step,
        loaded_step=report.loaded_step,
        counts={o: n for o, n in report.counts.items() if n},
        reasons={r.value: n for r, n in report.reasons.items()},
        ranks=report.ranks,
    )


def check_record(verdict: dict, run_id: str, timeline: int, time: float) -> StepCheckRecord:
    """The ingest body's record of a bad step, from the check's verdict (StepCheck's Verdict.as_dict())."""
    return msgspec.convert(
        {
            **{k: verdict[k] for k in ("step", "fault", "action", "triage", "applied", "ranks", "batch", "loss")},
            "evidence": verdict["evidence"],
            "run_id": run_id,
            "timeline": timeline,
            "time": time,
        },
        StepCheckRecord,
    )


_ENCODER = msgspec.json.Encoder()
_WARNED: set[str] = set()


def dumps(value) -> str:
    """Compact JSON of a plain value (a span, a summary its record refused)."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float the producer did not encode
        return json.dumps(jsonable(value), allow_nan=False, separators=(",", ":"))


def encode_summary(summary: dict) -> str:
    """A summary as its record, StepSummary: checked here as the sidecar will check it, then encoded.

    The training thread builds the summary as a dict (the shipper's thread adds its bubble causes
    before this); its record is made here, on the shipper's thread. One the record refuses is sent
    as it is, and the sidecar's 422 names the field (the file keeps it): a collector bug is seen,
    never hidden by a dropped summary."""
    try:
        return _ENCODER.encode(msgspec.convert(summary, StepSummary)).decode()
    except (msgspec.ValidationError, TypeError, ValueError) as err:
        if len(_WARNED) < 64 and str(err) not in _WARNED:  # once per fault, not once per step
            _WARNED.add(str(err))
            log.warning("parwatch: a step summary does not fit its record (%s); sent as built", err)
        return dumps(summary)


def encode_outcome(record: OutcomeRecord | StepCheckRecord) -> str:
    return _ENCODER.encode(record).decode()


class DirectiveInbox:
    """The sidecar's latest directive, written by the shipper thread and taken by the training thread.

    The sidecar repeats a directive in every reply until it has its outcome; `take()` hands
    each id over once. A reply without one (the directive was cancelled) empties the inbox.
    One attribute store per side: no lock is needed.
    """

    def __init__(self) -> None:
        self._latest: Directive | None = None
        self._taken: deque = deque(maxlen=256)  # ids already handed over (bounded)

    def put(self, raw: dict | None) -> None:
        """Shipper thread: validate and keep the reply's directive, or None (ValueError if malformed)."""
        self._latest = None if raw is None else parse_directive(raw)

    @property
    def latest(self) -> Directive | None:
        """The reply's directive last put (taken or not)."""
        return self._latest

    def take(self) -> Directive | None:
        directive = self._latest
        if directive is None or directive.id in self._taken:
            return None
        self._taken.append(directive.id)
        return directive
