"""Compact per-instance records of one rank's collectives and p2p transfers, for the sidecar.

A collective's time on one rank is its wait for the last member to arrive plus the transfer
itself; only the group as a whole can tell the two apart (the last arrival's duration is the
transfer). Each rank therefore ships, with its step summary, one small record per collective
and p2p instance of sampled steps: (op, group, seq, peer, arrival, duration, bytes). `seq` is
the call's number on its group (the trainer's spans carry it), so the same instance has the
same (group, seq) on every member and the sidecar can line the members up
(parwatch/sidecar/transfer.py). The step boundary's all-reduce (group "world" in the reference
trainer, or a `boundary` span) is not recorded: its time is the flush wait, not a transfer.

Cost on the training thread: one dict lookup and one list append per collective span of a
sampled step; data spans add one float. Budget: at most `per_group` instances per (op, group
or peer) per step, the first ones (every member makes the same calls in the same order, so
all members keep the same instances); see docs/architecture.md for the payload size.

Use (the collector, on the training thread):
    log = InstanceLog(host, seconds_of=collector._host_seconds, duration_of=clock.seconds)
    log.start(step)            # when a step period begins
    log.add(span)              # for every span, where its marks are resolvable (host clock: on_span;
                               # CUDA events: where the collector resolves them at the boundary)
    summary["instances"] = log.take()   # at the step boundary
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parwatch.contract import SpanKind
from parwatch.wire.steps import Instances

BOUNDARY, COLLECTIVE, DATA = SpanKind.BOUNDARY, SpanKind.COLLECTIVE, SpanKind.DATA
RECORDED_KINDS = frozenset({SpanKind.COLLECTIVE, SpanKind.SEND, SpanKind.RECV})
BOUNDARY_GROUPS = frozenset({"world"})
"""Collective groups that are the trainer's step boundary, never a transfer measurement."""


@dataclass(frozen=True)
class InstanceSampling:
    """Which steps ship instance records, and how many per group."""

    every: int = 1
    """Steps divisible by this are recorded (all ranks agree on step numbers); 0 records none."""
    per_group: int = 64
    """At most this many instances per (op, group) or (op, peer) per step: the first ones."""

    def __post_init__(self):
        if self.every < 0 or self.per_group < 1:
            raise ValueError(
                f"InstanceSampling(every={self.every}, per_group={self.per_group}): "
                "every must be >= 0 and per_group >= 1"
            )

    def __call__(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0


class InstanceLog:
    """One rank's records for the current step period."""

    __slots__ = (
        "host",
        "_seconds_of",
        "_duration_of",
        "_sampling",
        "_records",
        "_counts",
        "_groups",
        "_data",
        "_capped",
        "_sampled",
    )

    def __init__(
        self,
        host: str,
        seconds_of: Callable[[Any], float],
        duration_of: Callable[[Any, Any], float],
        sampling: InstanceSampling = InstanceSampling(),
    ):
        """seconds_of(mark): host-monotonic seconds of a mark (the arrival); duration_of(start, end):
        the clock's own span length (on CUDA, device time between the events)."""
        self.host = host
        self._seconds_of = seconds_of
        self._duration_of = duration_of
        self._sampling = sampling
        self._sampled = False
        self._reset()

    def _reset(self) -> None:
        self._records: list = []
        self._counts: dict = {}
        self._groups: dict = {}
        self._data = 0.0
        self._capped = 0

    def start(self, step: int) -> None:
        """A step period begins: forget the previous one, record this one if it is sampled."""
        self._reset()
        self._sampled = self._sampling(step)

    def add(self, span) -> None:
        kind = span.kind
        if kind == DATA:
            self._data += self._duration_of(span.start, span.end)
            return
        if not self._sampled or kind not in RECORDED_KINDS or kind == BOUNDARY:
            return
        attrs = span.attrs
        seq = attrs.get("seq")
        group = attrs.get("group", "pp")
        if seq is None or group in BOUNDARY_GROUPS:
            return  # a span without a sequence number cannot be matched across ranks
        op = attrs.get("op", kind)
        peer = attrs.get("peer", -1) if kind != COLLECTIVE else -1
        if kind == COLLECTIVE and group not in self._groups:
            ranks = attrs.get("ranks")
            if ranks is None:
                return  # members unknown: the sidecar could not tell when the instance is complete
            self._groups[group] = list(ranks)
        key = (op, group, peer)
        n = self._counts.get(key, 0)
        if n >= self._sampling.per_group:
            self._capped += 1
            return
        self._counts[key] = n + 1
        start = self._seconds_of(span.start)
        self._records.append(
            (
                op,
                group,
                int(seq),
                int(peer),
                round(start * 1e6),
                round(self._duration_of(span.start, span.end) * 1e6),
                int(attrs.get("bytes", 0)),
            )
        )

    def take(self) -> Instances:
        """A summary's `instances` for the period that just ended."""
        out = Instances(
            host=self.host, data_seconds=self._data, groups=self._groups, records=self._records, capped=self._capped
        )
        self._reset()
        return out
