"""The fast path: this observer's part of the step-boundary vector, and rank 0's view of it.

At boundary n every rank ADDS the breakdown of its PREVIOUS step (n-1) into the block of
its own stage: step n's own period is only known once boundary n has returned. After the
SUM all-reduce each stage's block holds the sums over its ranks (tp x dp of them) and
their count, so rank 0 reads the whole pipeline's view of step n-1 with one step of lag,
from pp blocks, whatever the world size: no per-rank rows, no O(world) work.

Slots: STEP (rank 0: the step described, +1; 0 means none), ORIGIN (rank 0, at the start
boundary: its wall clock, the time origin of every rank's span records), then one block of
STAGE_SLOTS per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from parwatch.bubble import stage_bubble
from parwatch.collector.stats import StepBreakdown
from parwatch.vocabulary import SpanKind, jsonable
from parwatch.wire.steps import GlobalStage, GlobalView

STEP, ORIGIN = 0, 1
HEADER = 2
# One stage's block: ranks that reported, then sums over them.
COUNT, STEP_SECONDS, COMPUTE, OTHER, IDLE, FORWARD, BACKWARD, BACKWARD_WEIGHT, LOSS = range(9)
STAGE_SLOTS = 9
PER_KIND = {
    SpanKind.FORWARD: FORWARD,
    SpanKind.BACKWARD: BACKWARD,
    SpanKind.BACKWARD_INPUT: BACKWARD,
    SpanKind.BACKWARD_WEIGHT: BACKWARD_WEIGHT,
    SpanKind.LOSS: LOSS,
}
"""Compute span kinds -> the block slot that sums them (a split backward's input half counts as backward)."""


def slots_for(pp: int) -> int:
    """Width of this observer's part of the boundary vector: independent of tp and dp."""
    return HEADER + pp * STAGE_SLOTS


def fill_slots(
    slots: list,
    *,
    rank: int,
    stage: int,
    previous: StepBreakdown | None,
    previous_step: int,
    by_kind: dict | None = None,
    origin: float | None = None,
) -> None:
    """Add this rank's figures of `previous_step` to its stage's block (nothing when previous is None)."""
    if rank == 0:
        if origin is not None:
            slots[ORIGIN] = origin
        if previous is not None:
            slots[STEP] = float(previous_step + 1)
    if previous is None:
        return
    base = HEADER + stage * STAGE_SLOTS
    slots[base + COUNT] = 1.0
    slots[base + STEP_SECONDS] = previous.step_seconds
    slots[base + COMPUTE] = previous.compute_seconds
    slots[base + OTHER] = previous.other_seconds
    slots[base + IDLE] = previous.idle_seconds
    for kind, seconds in (by_kind or {}).items():
        slot = PER_KIND.get(kind)
        if slot is not None:
            slots[base + slot] += seconds


def origin_of(slots: Sequence[float]) -> float | None:
    """Rank 0's wall-clock origin from a summed start boundary, or None if it sent none."""
    return slots[ORIGIN] or None


def build_global_view(slots: Sequence[float], pp: int, loss: float | None) -> GlobalView | None:
    """Rank 0's summary's `global` view from the summed slots, or None when no stage reported.

    A stage's numbers are the mean over its reporting ranks; its bubble is parwatch.bubble's,
    from those means (the ratio of the sums). Per-kind compute means (forward, backward,
    backward_weight, loss, per rank and step) let the bubble be split into its causes
    (parwatch.pipeline_sim)."""
    described = int(slots[STEP])
    if described <= 0:
        return None
    stages = []
    for stage in range(pp):
        base = HEADER + stage * STAGE_SLOTS
        n = slots[base + COUNT]
        if n <= 0:
            continue
        step_s, compute, other, idle = (slots[base + i] / n for i in (STEP_SECONDS, COMPUTE, OTHER, IDLE))
        stages.append(
            GlobalStage(
                stage=stage,
                compute_seconds=compute,
                idle_seconds=idle,
                other_seconds=other,
                step_seconds=step_s,
                bubble_ratio=stage_bubble(idle, compute),
                forward_seconds=slots[base + FORWARD] / n,
                backward_seconds=slots[base + BACKWARD] / n,
                backward_weight_seconds=slots[base + BACKWARD_WEIGHT] / n,
                loss_seconds=slots[base + LOSS] / n,
                ranks=int(n),
            )
        )
    if not stages:
        return None
    computes = [s.compute_seconds for s in stages]
    mean = sum(computes) / len(computes)
    # No compute anywhere: every stage is equal, so there is no skew.
    skew = max(computes) / mean if mean > 0 else 1.0
    slowest = max(stages, key=lambda s: s.compute_seconds).stage
    return GlobalView(
        step=described - 1,
        wire_loss=None if loss is None else jsonable(float(loss)),
        pipeline_skew_ratio=skew,
        slowest_stage=slowest,
        stages=stages,
    )
