"""The fast path: a few floats per rank in the trainer's step-boundary collective.

At boundary n every rank writes the breakdown of its PREVIOUS step (n-1): step
n's own period is only known once boundary n has returned. Rank 0 reads every
rank's row and builds the whole pipeline's view of step n-1, one step of lag,
without a collective of its own.

The row also carries a host key and, at the start boundary, each rank's
host-monotonic clock reading: ranks of one host then agree on one time origin
for their span records (CLOCK_MONOTONIC is shared by the processes of a host).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

from parwatch.collector.stats import StepBreakdown, bubble_ratio
from parwatch.schema import encode_float

# Slot layout of this observer's part of a rank's boundary row.
VALID, STEP, STAGE, STEP_SECONDS, COMPUTE, OTHER, IDLE, HOST_KEY, ORIGIN = range(9)
BOUNDARY_SLOTS = 9


def host_key(hostname: str) -> float:
    """A 48-bit hash of the hostname: exact as a float64, so equal hosts compare equal."""
    return float(int.from_bytes(hashlib.sha1(hostname.encode()).digest()[:6], "big"))


def fill_slots(
    slots: list,
    *,
    previous: StepBreakdown | None,
    previous_step: int,
    stage: int,
    host: float,
    origin_candidate: float | None = None,
) -> None:
    """Write one rank's slots; `previous` None marks the row invalid (no finished step to report).

    The host key goes out only with an origin candidate (first boundary): a nonzero key marks one.
    """
    slots[STAGE] = float(stage)
    if origin_candidate is not None:
        slots[HOST_KEY] = host
        slots[ORIGIN] = origin_candidate
    if previous is None:
        return
    slots[VALID] = 1.0
    slots[STEP] = float(previous_step)
    slots[STEP_SECONDS] = previous.step_seconds
    slots[COMPUTE] = previous.compute_seconds
    slots[OTHER] = previous.other_seconds
    slots[IDLE] = previous.idle_seconds


def shared_origin(slot_rows: Sequence[Sequence[float]], host: float) -> float | None:
    """The earliest origin candidate among the ranks of this host, or None if none was given."""
    candidates = [row[ORIGIN] for row in slot_rows if row[HOST_KEY] == host]
    return min(candidates) if candidates else None


def build_global_view(
    slot_rows: Sequence[Sequence[float]],
    stage_of: Callable[[int], int],
    step: int,
    loss: float | None,
) -> dict | None:
    """The schema's `global` object for `step` from every rank's slots, or None when no row is valid.

    A stage's numbers are the mean over its ranks (tp x dp); its bubble ratio is
    computed from those means. Rows for another step (a rank that just resumed) are left out.
    """
    sums: dict[int, list[float]] = {}
    for rank, row in enumerate(slot_rows):
        if row[VALID] != 1.0 or int(row[STEP]) != step:
            continue
        acc = sums.setdefault(stage_of(rank), [0.0, 0.0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += row[STEP_SECONDS]
        acc[2] += row[COMPUTE]
        acc[3] += row[OTHER]
        acc[4] += row[IDLE]
    if not sums:
        return None
    stages = []
    for stage in sorted(sums):
        n, step_s, compute, other, idle = sums[stage]
        step_s, compute, other, idle = step_s / n, compute / n, other / n, idle / n
        stages.append(
            {
                "stage": stage,
                "compute_seconds": compute,
                "idle_seconds": idle,
                "other_seconds": other,
                "step_seconds": step_s,
                "bubble_ratio": bubble_ratio(idle, step_s, other),
            }
        )
    computes = [s["compute_seconds"] for s in stages]
    mean = sum(computes) / len(computes)
    # No compute anywhere: every stage is equal, so there is no skew.
    skew = max(computes) / mean if mean > 0 else 1.0
    if loss is not None and not isinstance(loss, float):
        loss = float(loss)
    return {
        "step": step,
        "loss": None if loss is None else encode_float(loss),
        "pipeline_skew_ratio": skew,
        "stages": stages,
    }
