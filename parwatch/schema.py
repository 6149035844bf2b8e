"""The wire contract between collectors, the sidecar and offline tools (version 1).

The records that cross a process boundary are typed once, with their bounds and field docs:
the step summary, the ingest body and its answer (the directive), outcome records and the operator's
bodies in parwatch/step_records.py; activity reports, node digests and the decision log in
parwatch/records.py. parwatch/collector/wire.py builds a rank's step summary.

A loss, or any float that may be non-finite, travels as a number or one of the strings "nan", "inf",
"-inf" (parwatch.vocabulary.jsonable writes them; `decode_float` reads them).

Run directory files: summaries.jsonl (StepSummary per line), spans.jsonl (SpanRecord per
line, for the steps the collector samples), decisions.jsonl (sidecar decision records).

SpanRecord: {run_id, rank, stage, step, kind, start_s, end_s, attrs}
    start_s/end_s: seconds since the run's time origin (the first step boundary), so spans
    from different ranks on one host line up.
"""

from __future__ import annotations

from parwatch.vocabulary import CollectiveOp

SCHEMA_VERSION = 1
MAX_CHECKPOINTS = 1000
"""Checkpoint steps a summary (and the engine's state) carries: the newest ones."""

# Histogram upper bounds (seconds) for collective latency: 10 us .. 10 s, denser
# near the 1-50 ms range where TP all-reduces and p2p live and alert thresholds sit.
COLLECTIVE_BUCKETS = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

# Step duration histogram bounds (seconds).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for an op over n ranks."""
    if n <= 1:
        return 1.0 if op in (CollectiveOp.SEND, CollectiveOp.RECV, CollectiveOp.BROADCAST) else 0.0
    if op == CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
        return (n - 1) / n
    return 1.0


def decode_float(x) -> float | None:
    """A number as the wire carries it (parwatch.vocabulary.jsonable writes NaN/inf as strings)."""
    if x is None:
        return None
    if isinstance(x, str):
        if x in ("nan", "inf", "-inf"):
            return float(x)
        raise ValueError(f"not a number: {x!r} (expected a number, 'nan', 'inf' or '-inf')")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"not a number: {x!r}")
    return float(x)


# The activity report (parwatch.collector.activity -> parwatch.sidecar.activity_api), a rank's live state:
# its typed records are in parwatch/records.py.
HANG_EXIT_CODE = 75
"""Exit status of a rank the leader aborted for a hang (EX_TEMPFAIL): restart from the last checkpoint."""
MAX_TIME = 1e11
"""Largest unix time accepted (year 5138)."""


MAX_ERROR_CHARS = 200
"""A crashed rank's error text is cut to this many characters by the rank and checked by the sidecar."""


# How far a run can move: reports past these are refused, never taken as the run's newest state.
MAX_STEPS_PER_SECOND = 1000.0
"""Faster than any training run's steps: a summary or activity report that moves its rank further ahead of
the run's highest step than this pace allows since that step was first seen is refused (a forged step
10^9 would otherwise make every real rank look stalled behind it, or freeze the newest view)."""
MAX_TIMELINE = 100_000
"""Rollbacks applied in one run (a summary's timeline) at most."""
MAX_ROLLBACKS_PER_SECOND = 1.0
"""Faster than a run can load checkpoints: a timeline further ahead of the run's highest than this pace
allows since that timeline was first seen is refused (2^31 would otherwise stand as the newest forever)."""
