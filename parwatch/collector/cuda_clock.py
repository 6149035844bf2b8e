"""A timing clock whose marks are CUDA events: no per-op synchronisation.

`mark()` records a pooled `torch.cuda.Event(enable_timing=True)` on the current
stream and returns at once. The collector resolves marks only at the step
boundary, after the trainer's boundary collective whose result the host has
read: by then every event of the step has completed on the device, so
`elapsed_time` neither blocks nor needs a sync of its own. Resolved events go
back to the pool for the next step.

Host time: each mark also keeps `perf_counter_ns` at the moment it was recorded.
For the boundary's end mark (recorded when the stream has just been drained)
that pairs a device time with a host time; the collector converts the other
events of the step to host-monotonic seconds relative to it.
"""

from __future__ import annotations

import time

# Free events kept for reuse; beyond this they are left to the garbage collector.
MAX_POOLED_EVENTS = 8192


class CudaMark:
    """One recorded event and the host clock when it was recorded."""

    __slots__ = ("event", "host_ns", "free")

    def __init__(self, event) -> None:
        self.event = event
        self.host_ns = 0
        self.free = False


class CudaClock:
    """parwatch.contract.Clock on CUDA events; the collector resolves it at step boundaries."""

    resolves_at_boundary = True

    def __init__(self, device: int | None = None, torch_module=None) -> None:
        if torch_module is None:
            import torch as torch_module  # lazily: the collector must import without torch
        self._torch = torch_module
        self._device = device
        self._pool: list[CudaMark] = []
        self.created = 0
        """Events created so far: stays flat once the pool covers one step."""

    def mark(self) -> CudaMark:
        if self._pool:
            mark = self._pool.pop()
            mark.free = False
        else:
            mark = CudaMark(self._torch.cuda.Event(enable_timing=True))
            self.created += 1
        mark.event.record()
        mark.host_ns = time.perf_counter_ns()
        return mark

    def seconds(self, start: CudaMark, end: CudaMark) -> float:
        return start.event.elapsed_time(end.event) / 1e3

    def host_seconds(self, mark: CudaMark) -> float:
        """Host-monotonic seconds when the mark was recorded (not when the device reached it)."""
        return mark.host_ns * 1e-9

    def release(self, marks) -> None:
        """Return resolved marks to the pool; None and already-free marks are skipped."""
        pool = self._pool
        for mark in marks:
            if isinstance(mark, CudaMark) and not mark.free and len(pool) < MAX_POOLED_EVENTS:
                mark.free = True
                pool.append(mark)


def default_clock(ctx):
    """CUDA events when this rank has a GPU and torch sees CUDA; perf_counter_ns otherwise."""
    if ctx.local_gpu is not None:
        import torch

        if torch.cuda.is_available():
            return CudaClock(ctx.local_gpu, torch)
    from parwatch.contract import PerfCounterClock

    return PerfCounterClock()


def peak_memory_bytes() -> int | None:
    """torch.cuda.max_memory_allocated() since the last call, or None when CUDA is not in use.

    Reads torch from sys.modules so that merely asking never imports torch or starts CUDA.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak = int(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    return peak
