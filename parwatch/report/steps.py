"""The steps whose update never reached the weights, or was taken back: re-run, skipped and paused by the
check before the optimizer step (each summary of such a step carries its `check`), and the steps a
rollback discarded."""

from __future__ import annotations

from dataclasses import dataclass

from parwatch.report.loader import RunData
from parwatch.vocabulary import StepAction


@dataclass(frozen=True)
class KeptStep:
    """One step (or a range a rollback discarded) the weights did not keep as first computed."""

    first: int
    last: int
    timeline: int
    what: str
    """re-run (its re-run's update went in), skipped, skipped and paused, or rolled back."""
    triage: str = ""
    fault: str = ""
    ranks: tuple[int, ...] = ()

    @property
    def steps(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}..{self.last}"


_WHAT: dict[str, str] = {StepAction.RERUN: "re-run", StepAction.SKIP: "skipped", StepAction.PAUSE: "skipped, paused"}


def checked(run: RunData) -> list[KeptStep]:
    """The steps the check before the optimizer step found bad, once each (every rank's summary says it)."""
    seen: dict[tuple[int, int], KeptStep] = {}
    for s in run.summaries:
        check = s.get("check")
        key = (s.get("timeline", 0), s["step"])
        if isinstance(check, dict) and key not in seen:
            seen[key] = KeptStep(
                s["step"],
                s["step"],
                key[0],
                _WHAT.get(str(check.get("action")), str(check.get("action"))),
                str(check.get("triage", "")),
                str(check.get("fault", "")),
                tuple(check.get("ranks") or ()),
            )
    return [seen[k] for k in sorted(seen)]


def rolled_back(run: RunData) -> list[KeptStep]:
    """The steps each rollback discarded, from one rank's summaries in the order it wrote them: where the
    step goes back, the steps from there to the last one before it were taken back (a restart that resumed
    an older checkpoint reads the same: its steps were lost with the process)."""
    if not run.summaries:
        return []
    rank = min(s["rank"] for s in run.summaries)
    out, last, timeline = [], None, 0
    for s in run.summaries:
        if s["rank"] != rank:
            continue
        step = s["step"]
        if last is not None and step <= last:
            out.append(KeptStep(step, last, timeline, "rolled back"))
            timeline += 1
        last = step
    return out


def kept_from_weights(run: RunData) -> list[KeptStep]:
    """Every such step, in training order."""
    return sorted(checked(run) + rolled_back(run), key=lambda k: (k.timeline, k.first))
