"""The hook registry: free when nobody listens, faithful when someone does."""

import pytest

from parwatch import contract
from parwatch.contract import BoundaryInfo, HookRegistry, Observer, OutcomeReport


class CountingClock:
    """Marks are consecutive integers; counts how often the registry read the clock."""

    def __init__(self):
        self.reads = 0

    def mark(self):
        self.reads += 1
        return self.reads

    def seconds(self, start, end):
        return float(end - start)


class Recorder(Observer):
    def __init__(self, slots=0, fill=None, directive=None):
        self.boundary_slots = slots
        self.fill = fill or []
        self.directive = directive
        self.spans, self.boundaries, self.events = [], [], []

    def on_span(self, span):
        self.spans.append(span)

    def fill_boundary(self, step, slots):
        slots[:] = self.fill

    def pending_directive(self):
        return self.directive

    def on_boundary(self, info, slot_rows):
        self.boundaries.append((info, slot_rows))

    def on_event(self, name, attrs):
        self.events.append((name, attrs))


@pytest.fixture
def reg():
    r = HookRegistry()
    r.clock = CountingClock()
    return r


def test_without_observers_span_is_the_shared_null_object_and_reads_no_clock(reg):
    first = reg.span(contract.SpanKind.FORWARD, stage=0, microbatch=0, chunk=0)
    second = reg.span(contract.SpanKind.COLLECTIVE, op="all_reduce", group="tp", bytes=4, group_size=2)
    assert first is second is contract.spans._NULL_SPAN
    with first as span:
        assert span is None
    assert reg.mark() is None
    reg.emit_span(contract.SpanKind.SEND, 1, 2, op="send")
    reg.emit_event("run_start", rank=0)
    reg.emit_boundary(BoundaryInfo(1, "step", [], 0.0, None), [[], []])
    assert reg.clock.reads == 0 and not reg.active


def test_spans_arrive_with_their_attributes_and_ordered_marks(reg):
    rec = Recorder()
    reg.register(rec)
    with reg.span(contract.SpanKind.FORWARD, stage=1, microbatch=2, chunk=0):
        with reg.span(contract.SpanKind.COLLECTIVE, op="all_reduce", group="tp", bytes=4096, group_size=2):
            pass
    assert [s.kind for s in rec.spans] == [contract.SpanKind.COLLECTIVE, contract.SpanKind.FORWARD]  # inner ends first
    inner, outer = rec.spans
    assert all(s.start <= s.end for s in rec.spans)
    assert outer.start <= inner.start <= inner.end <= outer.end
    assert outer.attrs == dict(stage=1, microbatch=2, chunk=0)
    assert inner.attrs["bytes"] == 4096 and inner.attrs["group"] == "tp"


def test_a_span_is_reported_even_when_its_body_raises(reg):
    rec = Recorder()
    reg.register(rec)
    with pytest.raises(RuntimeError):
        with reg.span(contract.SpanKind.BACKWARD, stage=0):
            raise RuntimeError("boom")
    assert len(rec.spans) == 1 and rec.spans[0].end is not None


def test_every_observer_sees_every_span_and_unregister_stops_it(reg):
    a, b = Recorder(), Recorder()
    reg.register(a)
    reg.register(b)
    reg.emit_span(contract.SpanKind.SEND, 5, 9, op="send", bytes=8)
    reg.unregister(a)
    with reg.span(contract.SpanKind.OPTIMIZER, stage=0):
        pass
    assert len(a.spans) == 1 and len(b.spans) == 2
    assert (b.spans[0].start, b.spans[0].end) == (5, 9)
    reg.unregister(b)
    assert not reg.active and reg.span(contract.SpanKind.FORWARD) is contract.spans._NULL_SPAN


def test_boundary_slots_are_filled_and_sliced_per_observer(reg):
    two = Recorder(slots=2, fill=[1.0, 2.0])
    none = Recorder(slots=0)
    three = Recorder(slots=3, fill=[3.0, 4.0, 5.0])
    for obs in (two, none, three):
        reg.register(obs)
    assert reg.boundary_slots == 5
    row = [0.0] * reg.boundary_slots
    reg.fill_boundary(7, row)
    assert row == [1.0, 2.0, 3.0, 4.0, 5.0]

    # The summed vector (every rank's part added up), as the boundary all-reduce returns it.
    summed = [11.0, 22.0, 33.0, 44.0, 55.0]
    info = BoundaryInfo(
        step=7, kind="step", loss=1.5, directive=None, report=OutcomeReport(0, {}, {}, None, 2), world_size=2
    )
    reg.emit_boundary(info, summed)
    assert two.boundaries[0][1] == [11.0, 22.0]
    assert none.boundaries[0][1] == []
    assert three.boundaries[0][1] == [33.0, 44.0, 55.0]
    assert all(obs.boundaries[0][0] is info for obs in (two, none, three))


def test_pending_directive_is_the_first_observer_that_has_one(reg):
    reg.register(Recorder())
    reg.register(Recorder(directive="pause-1"))
    reg.register(Recorder(directive="rollback-2"))
    assert reg.pending_directive() == "pause-1"


def test_events_reach_every_observer(reg):
    a, b = Recorder(), Recorder()
    reg.register(a)
    reg.register(b)
    reg.emit_event("checkpoint_saved", step=3, checkpoints=[3])
    assert a.events == b.events == [("checkpoint_saved", {"step": 3, "checkpoints": [3]})]


def test_clear_restores_the_host_clock(reg):
    reg.register(Recorder())
    reg.clear()
    assert isinstance(reg.clock, contract.PerfCounterClock) and not reg.active and reg.observers == []


def test_perf_counter_clock_marks_increase_and_resolve_to_seconds():
    clock = contract.PerfCounterClock()
    a, b = clock.mark(), clock.mark()
    assert b >= a and clock.seconds(a, a + 2_000_000_000) == pytest.approx(2.0)
