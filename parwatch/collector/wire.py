"""The wire records the collector makes of the contract's objects (the directive outcome and check records
rank 0 sends), and the sidecar's directive it receives."""

from __future__ import annotations

from collections import deque

import msgspec

from parwatch.contract import Directive, OutcomeReport
from parwatch.contract.directives import parse_directive
from parwatch.vocabulary import Outcome
from parwatch.wire.steps import OutcomeRecord, StepCheckRecord


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
