"""Per-step aggregation on one rank: time categories and collective statistics.

Spans are folded into running sums as they are resolved, so a step costs a few
floats and one small record per (op, group) pair, however many spans it has.

Categories follow DESIGN.md: compute = forward + backward spans (TP collectives
nested inside them count here too); other = optimizer + dp_sync spans; idle is
what remains of the step period. Collective spans (and the DP all-reduces
nested in dp_sync) never add to a time category, so nothing is counted twice;
they feed the latency statistics only.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

from parwatch.bubble import stage_bubble
from parwatch.contract import COMPUTE_KINDS, OTHER_KINDS, SpanKind
from parwatch.vocabulary import CollectiveOp, GroupRole
from parwatch.wire.steps import COLLECTIVE_BUCKETS, Collective, busbw_factor

P2P_KINDS = frozenset({SpanKind.SEND, SpanKind.RECV})
COLLECTIVE_OPS = frozenset(CollectiveOp)
GROUPS = frozenset(GroupRole)
"""The sidecar refuses a summary with any other op or group, so spans of others are skipped (and counted)."""


@dataclass(frozen=True)
class StepBreakdown:
    """One step period on one rank, split as DESIGN.md defines it."""

    step_seconds: float
    compute_seconds: float
    other_seconds: float
    idle_seconds: float
    bubble_ratio: float


def breakdown(step_seconds: float, compute_seconds: float, other_seconds: float) -> StepBreakdown:
    # Idle cannot be negative; it only would if spans leaked in from outside the period.
    idle = max(0.0, step_seconds - compute_seconds - other_seconds)
    return StepBreakdown(
        step_seconds=step_seconds,
        compute_seconds=compute_seconds,
        other_seconds=other_seconds,
        idle_seconds=idle,
        bubble_ratio=stage_bubble(idle, compute_seconds),  # one rank, one step
    )


class OpStats:
    """Latency statistics of one (op, group) pair within one step."""

    __slots__ = ("op", "group", "group_size", "count", "seconds", "bytes", "bucket_hits")

    def __init__(self, op: CollectiveOp, group: GroupRole, group_size: int) -> None:
        self.op = op
        self.group = group
        self.group_size = group_size
        self.count = 0
        self.seconds = 0.0
        self.bytes = 0
        # Non-cumulative hits per bucket; the extra last slot is the +Inf overflow.
        self.bucket_hits = [0] * (len(COLLECTIVE_BUCKETS) + 1)

    def add(self, seconds: float, nbytes: int) -> None:
        self.count += 1
        self.seconds += seconds
        self.bytes += nbytes
        # Prometheus `le` semantics: a value equal to a bound falls in that bucket.
        self.bucket_hits[bisect_left(COLLECTIVE_BUCKETS, seconds)] += 1

    def record(self) -> Collective:
        algbw = self.bytes / self.seconds if self.seconds > 0 else 0.0
        return Collective(
            op=self.op,
            group=self.group,
            count=self.count,
            seconds=self.seconds,
            bytes=self.bytes,
            buckets=list(accumulate(self.bucket_hits)),
            algbw=algbw,
            busbw=algbw * busbw_factor(self.op, self.group_size),
        )


class StepStats:
    """Running sums for the current step period of one rank."""

    __slots__ = (
        "compute_seconds",
        "other_seconds",
        "by_kind",
        "other_by_kind",
        "comm_seconds",
        "comm_in_compute_seconds",
        "ops",
        "skipped_ops",
    )

    def __init__(self) -> None:
        self.compute_seconds = 0.0
        self.other_seconds = 0.0
        self.by_kind: dict[str, float] = {}
        """Compute seconds per span kind (forward, backward, ...): the bubble's causes need them."""
        self.other_by_kind: dict[str, float] = {}
        """Other seconds per span kind (optimizer, dp_sync, data, checkpoint, eval): the ledger's."""
        self.comm_seconds = 0.0
        """Collective spans outside any other span (idle in the breakdown) or inside a compute span."""
        self.comm_in_compute_seconds = 0.0
        """The part of comm_seconds inside compute spans (a TP all-reduce in a forward)."""
        self.ops: dict[tuple[str, str], OpStats] = {}
        self.skipped_ops = 0
        """Collective spans with an op or group the wire has no name for (whole run, not reset per step)."""

    def reset(self) -> None:
        self.compute_seconds = 0.0
        self.other_seconds = 0.0
        self.by_kind = {}
        self.other_by_kind = {}
        self.comm_seconds = 0.0
        self.comm_in_compute_seconds = 0.0
        self.ops = {}

    def add(self, kind: str, seconds: float, attrs: dict, parent_kind: str | None = None) -> None:
        """Fold one span; `parent_kind`: the kind of the span it ran inside, if any."""
        if kind in COMPUTE_KINDS:
            self.compute_seconds += seconds
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + seconds
        elif kind in OTHER_KINDS:
            self.other_seconds += seconds
            self.other_by_kind[kind] = self.other_by_kind.get(kind, 0.0) + seconds
        elif kind == SpanKind.COLLECTIVE:
            # Inside an optimizer or dp_sync span it is that span's time already; else it is
            # communication the rank waited in (inside a compute span, compute's time holds it).
            if parent_kind is None or parent_kind in COMPUTE_KINDS:
                self.comm_seconds += seconds
                if parent_kind is not None:
                    self.comm_in_compute_seconds += seconds
            self._add_op(
                attrs.get("op", "unknown"),
                attrs.get("group", "unknown"),
                attrs.get("group_size", 1),
                seconds,
                attrs.get("bytes", 0),
            )
        elif kind in P2P_KINDS:
            self._add_op(
                attrs.get("op", kind),
                attrs.get("group", "pp"),
                attrs.get("group_size", 2),
                seconds,
                attrs.get("bytes", 0),
            )
        # Other kinds are neither compute nor other: they are idle time. The boundary all-reduce
        # is mostly the wait for the pipeline's flush, not a transfer: it is no collective sample.

    def _add_op(self, op: str, group: str, group_size: int, seconds: float, nbytes: int) -> None:
        key = (op, group)
        stats = self.ops.get(key)
        if stats is None:
            if op not in COLLECTIVE_OPS or group not in GROUPS:
                self.skipped_ops += 1
                return
            stats = self.ops[key] = OpStats(CollectiveOp(op), GroupRole(group), int(group_size))
        stats.add(seconds, int(nbytes))

    def collectives(self) -> list[Collective]:
        """A summary's `collectives`, ordered by (group, op) so diffs stay readable."""
        return [self.ops[key].record() for key in sorted(self.ops, key=lambda k: (k[1], k[0]))]
