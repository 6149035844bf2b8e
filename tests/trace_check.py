"""An independent check of the goodput ledger: a profiler's chrome trace of the same steps, read without
any of parwatch's code (tests/dist/test_ledger_profiler.py on CPU; benchmarks/gpu_check.py on CUDA, where
the busy intervals are the device's kernels).

The trainer places a marker (a zero-length `record_function` named MARK + step) right after each step
boundary returns; the window is from one marker to another. Busy is the union of the compute intervals
in it (collectives and point-to-point ops left out, and the ops of a batch fetch the trainer marks with
DATA_MARK, which the ledger has as data wait), idle the rest. The ledger's view of the same window
is the difference of the cumulative `time_seconds` of the summaries at its two step boundaries.
"""

from __future__ import annotations

import json
import re

MARK = "ledger-test-boundary:"
BEFORE = "ledger-test-before:"
"""A marker a trainer may place right before a step boundary is called (named for the step it returns):
the ledger cuts its counters inside that call, so its window lies between window_bounds' two figures."""
DATA_MARK = "ledger-test-data"
"""A record_function the trainer may place around its batch fetch: ops inside it are the ledger's data wait
(the rank fetching its batch, not computing the model), so they are not busy either."""
BUSY = ("productive", "optimizer")
"""The ledger categories that are the rank computing (the profiler's busy); the rest is idle."""
COMM = re.compile(
    r"c10d|gloo|nccl|record_param_comms|send|recv|wait|barrier|all_?reduce|broadcast|gather|scatter", re.IGNORECASE
)
"""Op and kernel names of collectives and point-to-point transfers: a rank waiting in them is not computing."""


def trace_busy(path: str, first: int, last: int, category: str = "cpu_op") -> tuple[float, float]:
    """(window seconds, busy seconds) of one rank's chrome trace between the markers after steps
    `first` and `last`: busy is the union of the intervals of its `category` events ("cpu_op": the host's
    ops; "kernel": the device's), nested or overlapping ones counted once."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    marks = {int(e["name"][len(MARK) :]): float(e["ts"]) for e in events if e["name"].startswith(MARK)}
    start, end = marks[first], marks[last]
    fetches = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e["name"] == DATA_MARK]

    def fetching(e: dict) -> bool:
        lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        return any(a <= lo and hi <= b for a, b in fetches)

    spans = sorted(
        (max(start, float(e["ts"])), min(end, float(e["ts"]) + float(e["dur"])))
        for e in events
        if e.get("cat") == category and not COMM.search(e["name"]) and not fetching(e)
    )
    busy, reach = 0.0, start
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            busy += hi - lo
            reach = hi
    return (end - start) * 1e-6, busy * 1e-6


def window_bounds(path: str, first: int, last: int) -> tuple[float, float]:
    """(shortest, longest) seconds the ledger's window between the boundaries of steps `first` and `last`
    can span: from the end of the first boundary's call to the start of the last's, and from the start of
    the first's to the end of the last's (the BEFORE and MARK markers around each call)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    after = {int(e["name"][len(MARK) :]): float(e["ts"]) for e in events if e["name"].startswith(MARK)}
    before = {int(e["name"][len(BEFORE) :]): float(e["ts"]) for e in events if e["name"].startswith(BEFORE)}
    return (before[last] - after[first]) * 1e-6, (after[last] - before[first]) * 1e-6


def ledger_busy(summaries: list[dict], rank: int, first: int, last: int) -> tuple[float, float, dict]:
    """(window seconds, busy seconds, every category's seconds) of the ledger between the two step
    boundaries: differences of the cumulative counters (wasted is counted again inside productive's
    gross counter, so the window is the sum of the rest)."""
    at = {s["step"]: s["time_seconds"] for s in summaries if s["rank"] == rank and "time_seconds" in s}
    delta = {c: at[last][c] - at[first].get(c, 0.0) for c in at[last]}
    window = sum(v for c, v in delta.items() if c != "wasted")
    return window, sum(delta[c] for c in BUSY), delta
