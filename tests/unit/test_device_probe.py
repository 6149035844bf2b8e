"""The CUDA device-busy classifier (parwatch.collector.device) over recorded event timelines: at each
sample, which of the step's span marks the device had reached (what cudaEventQuery answered), as a rank
on a GPU records them. No GPU here; benchmarks/gpu_check.py checks the same on a real device with a
spinning kernel (torch.cuda._sleep)."""

from __future__ import annotations

from parwatch.collector.device import STUCK_SECONDS, DeviceProbe

# One step of a pipeline stage: forward (a TP all-reduce inside it), send, backward; then the boundary,
# where the host waits. Marks in recording order: (span, its start mark, its end mark).
SPANS = [("forward", "f0", "f1"), ("collective", "c0", "c1"), ("backward", "b0", "b1"), ("boundary", "x0", None)]
ORDER = {"f0": 0, "c0": 1, "b0": 3, "x0": 5}


def _spans():
    return [(kind, start, end, ORDER[start]) for kind, start, end in SPANS]


def _replay(timeline):
    """timeline: [(time, marks the device had reached by then)] -> the probe's answer at each sample."""
    reached: set[str] = set()
    probe = DeviceProbe(done=lambda mark: mark in reached)
    out = []
    for t, marks in timeline:
        reached.clear()
        reached.update(marks)
        out.append(probe.sample(_spans(), t))
    return out


def test_a_device_that_stays_on_one_forward_while_the_host_waits_is_reported_after_a_second():
    # The host is at the boundary (x0 recorded) but the device never gets past the forward's start:
    # a kernel spinning in the forward (a device hang), sampled once a second.
    timeline = [(t, {"f0"}) for t in (10.0, 11.0, 12.0, 13.5)]
    assert _replay(timeline) == [None, ("forward", 10.0), ("forward", 10.0), ("forward", 10.0)]


def test_the_innermost_unfinished_span_is_the_work():
    timeline = [(t, {"f0", "c0"}) for t in (10.0, 10.5, 11.0)]  # inside the forward's TP all-reduce
    assert _replay(timeline)[-1] == ("collective", 10.0)


def test_a_device_making_progress_is_never_reported():
    timeline = [
        (10.0, {"f0"}),
        (10.6, {"f0", "c0", "c1"}),  # the all-reduce done, still in the forward: the same work as before...
        (11.2, {"f0", "c0", "c1", "f1", "b0"}),  # ... and on into the backward: new work, the clock restarts
        (11.8, {"f0", "c0", "c1", "f1", "b0", "b1", "x0"}),  # caught up: idle, waiting for the host
        (13.0, {"f0", "c0", "c1", "f1", "b0", "b1", "x0"}),
    ]
    answers = _replay(timeline)
    assert answers[1] is None and answers[2] is None  # 0.6 s each: the device's pace
    assert answers[3] is None and answers[4] is None  # every span it was given is done, or open on the host


def test_a_device_that_has_not_reached_the_step_reports_nothing():
    assert _replay([(t, set()) for t in (10.0, 12.0, 14.0)]) == [None, None, None]


def test_a_recycled_mark_is_skipped_not_raised():
    def boom(mark):
        raise RuntimeError("event recorded again")

    probe = DeviceProbe(done=boom)
    assert probe.sample(_spans(), 10.0) is None
    assert STUCK_SECONDS == 1.0
