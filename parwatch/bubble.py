"""The pipeline bubble, defined once: a stage's measured bubble, the schedule's theory, the excess.

A stage's bubble over a window (one step, a Prometheus rate window, a whole run) is the share of
its ranks' pipeline time spent idle:

    sum over the stage's ranks and the window's steps of idle seconds
    ------------------------------------------------------------------
    the same sum of idle + compute seconds   (idle + compute = step - other)

Time-weighted, not the mean of per-rank ratios: a rank whose optimizer or DP sync ("other") ran
long has less pipeline time, and its ratio must weigh less (docs/architecture.md, "One bubble").
The guardrail (collector.global_view, one step), the recording rules, hence the dashboard and the
alerts (`promql`, a Prometheus rate window), and the report (its steps after the first) all call
this module; tests/integration/test_bubble_one_definition.py checks they agree on one run.
"""

from __future__ import annotations

from parwatch import vocabulary
from parwatch.catalog import metric

IDLE_COUNTER = metric("parwatch_stage_idle_seconds_total").name
COMPUTE_COUNTER = metric("parwatch_stage_compute_seconds_total").name
THEORY_GAUGE = metric("parwatch_stage_bubble_theoretical_ratio").name

CLOSED_FORM_SCHEDULES = tuple(s.name for s in vocabulary.SCHEDULES.values() if s.closed_form)
"""Schedules whose bubble at uniform stages is (p-1)/(v*m+p-1) (their aliases too: see `has_closed_form`);
any other's theory is its replay at equal action times (`replayed_theory`)."""
EQUAL_ACTION_SECONDS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Action times of the uniform replay: a backward costs two forwards, split evenly into I and W."""


# --- measured ---------------------------------------------------------------------------------


def stage_bubble(idle_seconds: float, compute_seconds: float) -> float:
    """idle / (idle + compute) of sums (or means) over a stage's ranks and a window's steps; one
    rank and one step gives that rank's bubble. 0 when the window holds no pipeline time."""
    pipeline = idle_seconds + compute_seconds
    return idle_seconds / pipeline if pipeline > 0 else 0.0


def excess(measured: float, theoretical: float) -> float:
    """The part of the bubble a user can fix: measured minus the schedule's theory."""
    return measured - theoretical


# --- theory -----------------------------------------------------------------------------------


def has_closed_form(name: str) -> bool:
    """Whether `name` (any spelling the registry knows) has a closed-form bubble."""
    entry = vocabulary.schedule(name)
    return entry is not None and entry.closed_form


def closed_form(pp: int, microbatches: int, chunks: int = 1) -> float:
    """(p-1)/(v*m+p-1): GPipe and 1F1B with v=1, interleaved 1F1B and looped BFS with v chunks."""
    return (pp - 1) / (chunks * microbatches + pp - 1)


def theoretical(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """The closed-form bubble of `schedule` with uniform stages; ValueError for a schedule without
    one (zero bubble, DualPipeV: replay its order with `replayed_theory`) or impossible sizes."""
    entry = vocabulary.schedule(schedule)
    if entry is None or not entry.closed_form:
        raise ValueError(
            f"no closed form for schedule {schedule!r} (have {', '.join(CLOSED_FORM_SCHEDULES)}); "
            "replay its action lists instead (parwatch.bubble.replayed_theory)"
        )
    for label, value in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive integer")
    if entry.one_chunk and chunks != 1:
        raise ValueError(f"chunks={chunks} needs an interleaved schedule; {schedule} has one chunk per stage")
    return closed_form(pp, microbatches, chunks)


def replayed_theory(replay) -> float | None:
    """A schedule's bubble at equal action times: the mean over ranks of a parwatch.pipeline_sim
    Replay's bubble. The theory of schedules without a closed form; None for an empty order."""
    bubbles = replay.run(EQUAL_ACTION_SECONDS).bubble
    return sum(bubbles.values()) / len(bubbles) if bubbles else None


# --- PromQL -----------------------------------------------------------------------------------


def promql(window: str, keep: tuple[str, ...]) -> str:
    """`stage_bubble` over a rate window, per `keep` labels (the run's and `stage`): the counters'
    rates are the window's sums per second, so their ratio is the time-weighted bubble. No sample
    when the window holds no pipeline time (a paused or stopped run)."""
    by = f"by ({', '.join(keep)})"
    idle = f"sum {by} (rate({IDLE_COUNTER}[{window}]))"
    compute = f"sum {by} (rate({COMPUTE_COUNTER}[{window}]))"
    return f"{idle} / ({idle} + {compute} > 0)"


def theory_promql(keep: tuple[str, ...]) -> str:
    """Every sidecar exports the theory of the stages it sees: max dedups them."""
    return f"max by ({', '.join(keep)}) ({THEORY_GAUGE})"


def excess_promql(window: str, keep: tuple[str, ...]) -> str:
    """`excess` of `promql` over the theory, matched on `keep`."""
    return f"{promql(window, keep)} - on ({', '.join(keep)}) {theory_promql(keep)}"
