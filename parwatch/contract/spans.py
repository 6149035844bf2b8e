"""Spans and events: what a trainer announces, and the registry observers subscribe to.

With no observer registered, `registry.span()` returns one shared no-op context
manager and the `emit_*` methods return at the first `if`: no clock is read,
nothing is allocated, so an unobserved trainer pays nothing.

Timing marks come from the registry's clock. On CPU that is `time.perf_counter_ns`;
an observer on GPU installs a clock whose marks are CUDA events, resolved after the
step has finished on the device (no per-op synchronisation). Trainers never
interpret marks themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from parwatch.contract.directives import Directive
from parwatch.vocabulary import BoundaryKind as BoundaryKind  # the contract's names, defined with the vocabulary
from parwatch.vocabulary import Event as Event
from parwatch.vocabulary import SpanKind as SpanKind

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from 3.11

    from parwatch.contract.boundary import BoundaryInfo  # boundary imports this module


COMPUTE_KINDS = frozenset(
    {SpanKind.FORWARD, SpanKind.BACKWARD, SpanKind.BACKWARD_INPUT, SpanKind.BACKWARD_WEIGHT, SpanKind.LOSS}
)
"""Count as compute (the pipeline's work)."""
OTHER_KINDS = frozenset({SpanKind.OPTIMIZER, SpanKind.DP_SYNC, SpanKind.CHECKPOINT, SpanKind.DATA, SpanKind.EVAL})
"""Work that is not the pipeline's and must not read as bubble. Everything else is communication or waiting."""
SEQUENCED_KINDS = frozenset({SpanKind.COLLECTIVE, SpanKind.SEND, SpanKind.RECV})
"""Spans the registry numbers per group (collectives) or per peer (send, recv) in `attrs["seq"]`."""


class Clock(Protocol):
    """Produces opaque timing marks; `seconds(start, end)` resolves a pair."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class PerfCounterClock:
    """Host clock: marks are `perf_counter_ns` integers."""

    mark = staticmethod(time.perf_counter_ns)
    """The builtin itself, not a Python function around it: a span reads it twice."""

    def seconds(self, start: int, end: int) -> float:
        return (end - start) * 1e-9


@dataclass(slots=True)
class Span:
    """One timed interval. `attrs` holds what the kind needs:

    forward, backward*, loss: stage, microbatch, chunk
    send/recv: stage, microbatch, chunk, peer, what ("activation" | "grad"), op ("send" | "recv"),
               group "pp", bytes, group_size 2, seq. A send runs from posting the isend to its completion.
    collective: op, group ("tp" | "pp" | "dp" | "world" | ...), bytes, group_size, seq
    optimizer, dp_sync, checkpoint, data: stage (a dp_sync whose all-reduce is not its own span may name its
               `group`, "dp": the hang analysis then reads it as a wait for that group)

    Observers treat `attrs` as read-only (and copy what they change): an emitter may share one attrs
    dict between the spans of every step, as the torch pipelining integration does per stage and
    microbatch.
    """

    kind: SpanKind
    start: Any
    end: Any = None
    attrs: dict[str, Any] = field(default_factory=dict)
    parent: Span | None = None
    """The span that was open when this one began (a TP collective inside a forward)."""


class Observer:
    """Base observer: override what you need. All methods run on the training thread and must
    be quick; heavy work belongs on the observer's own thread."""

    boundary_slots: int = 0
    """Floats this observer adds to the step-boundary vector (after the contract's header)."""

    def on_span(self, span: Span) -> None:
        pass

    def fill_boundary(self, step: int, slots: list[float]) -> None:
        """Add this rank's contributions to this observer's `boundary_slots` floats (zero-filled).

        The vector is SUM all-reduced over every rank: write a value only one rank writes
        (rank 0), or add to a sum (a per-stage block, a count)."""

    def pending_directive(self) -> Directive | None:
        """Rank 0 only: a directive to hand every rank, or None."""
        return None

    def directs(self) -> bool:
        """True when this observer can bring the run directives (it reports to a sidecar an operator
        reaches): a pause can end. A run with none that pauses exits instead (StepBoundary.hold)."""
        return False

    def settle(self, step: int, timeout_s: float) -> None:
        """Rank 0, after the run's last step (before the settling boundary): what the last steps' judgement
        needs sent, and their directive, if any, made pending (at most `timeout_s`)."""

    def during_boundary(self) -> None:
        """While the boundary's all-reduce is in flight (trainers whose all-reduce is asynchronous;
        see StepBoundary): work that needs not its result, such as folding the step's spans."""

    def on_boundary(self, info: BoundaryInfo, slots: list[float]) -> None:
        """`slots`: this observer's floats, summed over ranks."""

    def on_event(self, name: Event, attrs: dict[str, Any]) -> None:
        """Rare events (see Event)."""


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


_NULL_SPAN = _NullSpan()


_ns = time.perf_counter_ns


class _LiveSpan(Span):
    """The span `registry.span()` returns is its own context manager: one object per span.

    A span's hooks often run right after the thread wakes (a sleep, a blocking receive), when
    the CPU's caches hold other work: there every Python call and object costs ~5-10x its
    cost in a tight loop, so this path keeps both few. What it costs is added to
    `registry.hook_ns` (two clock reads on each side, plain int adds)."""

    __slots__ = ("_reg", "_t0")

    def __init__(self, reg: HookRegistry, kind: SpanKind, attrs: dict[str, Any], t0: int):
        self._reg = reg
        self.kind = kind
        self.attrs = attrs
        self.end = None
        self._t0 = t0

    def __enter__(self) -> Self:
        reg = self._reg
        self.parent = reg.current
        self.start = reg.clock.mark()
        reg.current = self  # one store, after start: an activity reporter reads both from its own thread
        reg.hook_ns += _ns() - self._t0  # from registry.span() on: building the span and entering it
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        t0 = _ns()
        reg = self._reg
        self.end = reg.clock.mark()
        reg.current = self.parent
        for on_span in reg.sinks:
            on_span(self)
        reg.hook_ns += _ns() - t0
        return False


class HookRegistry:
    def __init__(self) -> None:
        self.observers: list[Observer] = []
        self.sinks: tuple[Callable[[Span], None], ...] = ()
        """The observers' bound `on_span` methods (kept in step with `observers` by register/unregister)."""
        self.clock: Clock = PerfCounterClock()
        self.active = False
        self.current: Span | None = None
        """The innermost open span of the training thread, or None (read by activity reporters)."""
        self.sequence: dict[tuple[SpanKind, object], int] = {}
        """Per-group collective and per-peer send/recv counts: span attrs' `seq`."""
        self.hook_ns = 0
        """Nanoseconds the training thread spent in span hooks while observed (`span()` and its enter and
        exit, and wrappers that time spans themselves), since the process started: parwatch's own cost.
        Only the training thread adds to it (threads that `emit_span` do not), so a plain int suffices."""

    def register(self, observer: Observer) -> None:
        self.observers.append(observer)
        self.sinks = tuple(o.on_span for o in self.observers)
        self.active = True

    def unregister(self, observer: Observer) -> None:
        self.observers.remove(observer)
        self.sinks = tuple(o.on_span for o in self.observers)
        self.active = bool(self.observers)
        if not self.active:
            self.current = None

    def clear(self) -> None:
        self.observers.clear()
        self.sinks = ()
        self.clock = PerfCounterClock()
        self.active = False
        self.current = None
        self.sequence.clear()

    def next_seq(self, kind: SpanKind, attrs: dict[str, Any]) -> int:
        """The next sequence number of this span's group (collectives) or peer (send, recv)."""
        key = (kind, attrs.get("group")) if kind == SpanKind.COLLECTIVE else (kind, attrs.get("peer"))
        seq = self.sequence.get(key, 0) + 1
        self.sequence[key] = seq
        return seq

    def span(self, kind: SpanKind, **attrs: Any) -> AbstractContextManager[Span | None, Literal[False]]:
        if not self.active:
            return _NULL_SPAN
        t0 = _ns()
        if kind in SEQUENCED_KINDS and "seq" not in attrs:
            attrs["seq"] = self.next_seq(kind, attrs)
        return _LiveSpan(self, kind, attrs, t0)

    def mark(self) -> Any:
        """A clock mark, or None when nobody observes."""
        return self.clock.mark() if self.active else None

    def emit_span(self, kind: SpanKind, start: Any, end: Any, **attrs: Any) -> None:
        """Report a span timed elsewhere (an isend, from its post to its completion). Sends should
        take `seq` from next_seq() when posted, so it follows the program's order."""
        if not self.active:
            return
        if kind in SEQUENCED_KINDS and "seq" not in attrs:
            attrs["seq"] = self.next_seq(kind, attrs)
        span = Span(kind, start, end, attrs)
        for on_span in self.sinks:
            on_span(span)

    def emit(self, span: Span) -> None:
        """Report a finished Span the caller built (marks set; `seq` from next_seq() if sequenced).

        emit_span without the keyword-argument copy, for hooks that build their spans ahead."""
        for on_span in self.sinks:
            on_span(span)

    @property
    def boundary_slots(self) -> int:
        return sum(o.boundary_slots for o in self.observers)

    def fill_boundary(self, step: int, part: list[float]) -> None:
        """`part`: the observers' slice of this rank's boundary vector, zero-filled."""
        offset = 0
        for obs in self.observers:
            n = obs.boundary_slots
            if n:
                slots = [0.0] * n
                obs.fill_boundary(step, slots)
                part[offset : offset + n] = slots
                offset += n

    def pending_directive(self) -> Directive | None:
        for obs in self.observers:
            d = obs.pending_directive()
            if d is not None:
                return d
        return None

    def directed(self) -> bool:
        """Some observer can bring this rank directives (Observer.directs). An observer written before
        `directs` existed (observers are duck-typed: settle too may be missing) counts when it offers
        directives at all: a pause it could end must not become an exit."""
        return any(
            obs.directs() if hasattr(obs, "directs") else hasattr(obs, "pending_directive") for obs in self.observers
        )

    def settle(self, step: int, timeout_s: float) -> None:
        for obs in self.observers:
            settle = getattr(obs, "settle", None)  # newer than the rest: observers may lack it
            if settle is not None:
                settle(step, timeout_s)

    def during_boundary(self) -> None:
        for obs in self.observers:
            during = getattr(obs, "during_boundary", None)  # newer than the rest: observers may lack it
            if during is not None:
                during()

    def emit_boundary(self, info: BoundaryInfo, part: list[float]) -> None:
        offset = 0
        for obs in self.observers:
            n = obs.boundary_slots
            obs.on_boundary(info, part[offset : offset + n])
            offset += n

    def emit_event(self, name: Event, **attrs: Any) -> None:
        for obs in self.observers:
            obs.on_event(name, attrs)


registry = HookRegistry()
"""One registry per process: a rank is one process."""
