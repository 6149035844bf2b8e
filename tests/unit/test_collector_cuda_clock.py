"""The CUDA-event clock: pooled events resolved only at step boundaries.

A fake torch.cuda stands in on CPU: its events refuse `elapsed_time` until the
simulated stream has reached them, as a real event that has not completed does,
so these tests prove the collector never resolves a mark early (which on a GPU
would mean waiting on the device).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_collector_sim import SimRank, SimRun, ctx_for, run_steps

from parwatch.collector.cuda_clock import CudaClock


class FakeDevice:
    def __init__(self) -> None:
        self.now = 0.0  # device time the stream has been enqueued up to
        self.completed = -1.0  # device time the stream has executed up to
        self.early_reads = 0

    def torch(self):
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = device.now

            def elapsed_time(self, other):
                if max(self.t, other.t) > device.completed:
                    device.early_reads += 1
                    raise RuntimeError("CUDA error: device not ready")
                return (other.t - self.t) * 1e3

        return SimpleNamespace(cuda=SimpleNamespace(Event=Event))


class FakeCudaClock(CudaClock):
    def __init__(self, device: FakeDevice) -> None:
        super().__init__(0, device.torch())
        self.device = device

    def at(self, t: float) -> None:
        self.device.now = t


def cuda_run(share_marks=False):
    devices = [FakeDevice(), FakeDevice()]
    run = SimRun([SimRank(ctx_for(r), clock=FakeCudaClock(devices[r])) for r in range(2)])

    def drained():  # the host reads the boundary's result: every earlier event has completed
        for d in devices:
            d.completed = d.now

    original = run.boundary
    run.boundary = lambda *a, **kw: original(*a, on_collective=drained, share_marks=share_marks, **kw)
    return run, devices


@pytest.mark.parametrize("share_marks", [False, True], ids=["own-marks", "span-marks"])
def test_cuda_marks_give_the_same_breakdown_and_are_never_read_early(share_marks):
    run, devices = cuda_run(share_marks)
    run.boundary(0, "start", 0.0, 0.1)
    run_steps(run, 3, 0.1, gap=0.003)
    for rank, device in zip(run.ranks, devices):
        s = rank.collector.last_summary
        assert s.step_seconds == pytest.approx(0.158, abs=1e-9)
        assert s.compute_seconds == pytest.approx(0.12, abs=1e-9)
        assert s.idle_seconds == pytest.approx(0.033, abs=1e-9)
        assert device.early_reads == 0 and rank.collector.unresolved_spans == 0
    assert run.ranks[0].collector.last_summary.global_.step == 2


def test_events_are_pooled_so_their_number_stays_flat():
    run, _ = cuda_run()
    run.boundary(0, "start", 0.0, 0.1)
    t = run_steps(run, 2, 0.1)
    created = [rank.clock.created for rank in run.ranks]
    run_steps(run, 20, t, first_step=3)
    assert [rank.clock.created for rank in run.ranks] == created


def test_span_records_convert_event_times_to_host_seconds():
    run, _ = cuda_run()
    run.boundary(0, "start", 0.0, 0.1)
    records = []
    for rank in run.ranks:
        rank.collector.shipper.put_spans = records.extend
        rank.collector.shipper._paths["spans"] = "captured"
    run_steps(run, 1, 0.1)
    forwards = sorted((r for r in records if r["kind"] == "forward" and r["rank"] == 0), key=lambda r: r["start_s"])
    assert len(forwards) == 4
    for a, b in zip(forwards, forwards[1:]):
        assert b["start_s"] - a["start_s"] == pytest.approx(0.010, abs=1e-6)
        assert a["end_s"] - a["start_s"] == pytest.approx(0.010, abs=1e-6)


def test_release_skips_foreign_and_already_free_marks():
    clock = FakeCudaClock(FakeDevice())
    a, b = clock.mark(), clock.mark()
    clock.release([a, a, None, 12345, b])
    assert len(clock._pool) == 2
    assert {id(clock.mark()), id(clock.mark())} == {id(a), id(b)} and clock.created == 2


@pytest.mark.gpu
def test_real_cuda_events_time_a_matmul_without_host_sync_per_mark():
    import torch

    clock = CudaClock(0)
    x = torch.randn(2048, 2048, device="cuda")
    start = clock.mark()
    for _ in range(10):
        x = x @ x / 2048
    end = clock.mark()
    torch.cuda.synchronize()  # the test stands in for the trainer's boundary read
    assert clock.seconds(start, end) > 0
    clock.release([start, end])
    again = clock.mark(), clock.mark()
    torch.cuda.synchronize()
    assert clock.created == 2 and clock.seconds(*again) >= 0
