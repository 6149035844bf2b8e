"""The step boundary's all-reduce over torch.distributed, for StepBoundary.

One definition for every trainer that runs on torch.distributed (the reference trainer and
the torch pipelining integration). torch is imported when one is built, not when the
contract is imported, so the contract stays free of dependencies.

It is asynchronous: the call starts the all-reduce and returns a waiter, so StepBoundary
lets the observers fold the step's spans while it is in flight. On CPU the vector lives in
one array-backed tensor per width, reused every step: right after a step the caches are
cold, and there building a tensor from a list costs a third more (docs/benchmarks.md).

`close()` belongs before `destroy_process_group` and interpreter exit. torch's collective
thread (gloo's worker, NCCL's watchdog) lets go of a finished work after `wait()` has
returned, and that release can need the GIL. When the training thread runs on to the end of
the program without once giving up the GIL, the worker is still waiting for it when the
interpreter starts to finalize; it is then made to exit inside the work's destructor and the
C++ runtime aborts the process ("terminate called without an active exception", SIGABRT
after a run that completed: issue 26, with a gdb backtrace in docs/shutdown.md). `close()`
waits, GIL released, until torch holds none of the tensors it was lent.
"""

from __future__ import annotations

import ctypes
import logging
import time
from array import array
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # for the checker only: importing the contract must not import torch
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger("parwatch.contract")


class _Work(Protocol):
    """What torch.distributed's collectives return with async_op=True (their stubs leave it untyped)."""

    def wait(self, timeout: timedelta = ...) -> bool: ...


class TorchAllReduce:
    """`all_reduce_sum` for StepBoundary: a float64 SUM all-reduce of `group` (None: the world)
    on `device` (None: CPU, as gloo wants it; a CUDA device for NCCL)."""

    def __init__(self, group: ProcessGroup | None = None, device: torch.device | str | int | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
        self._buffers: dict[int, tuple[array[float], torch.Tensor]] = {}  # CPU: width -> (array, tensor sharing it)
        self._last: tuple[_Work, torch.Tensor] | None = None  # (work, tensor) of the latest all-reduce

    def __call__(self, values: list[float]) -> Callable[[], list[float]]:
        if self.device is not None:
            vec = self._torch.tensor(values, dtype=self._torch.float64, device=self.device)
            work: _Work = self._dist.all_reduce(vec, group=self.group, async_op=True)
            self._last = (work, vec)

            def device_result() -> list[float]:
                work.wait()
                return vec.tolist()  # host read: the one sync a step has anyway

            return device_result
        buffer = self._buffers.get(len(values))
        if buffer is None:
            host = array("d", values)
            buffer = self._buffers[len(values)] = (host, self._torch.frombuffer(host, dtype=self._torch.float64))
        else:
            buffer[0][:] = array("d", values)
        host, vec = buffer
        work = self._dist.all_reduce(vec, group=self.group, async_op=True)
        self._last = (work, vec)

        def result() -> list[float]:
            work.wait()
            return host.tolist()

        return result

    def close(self, timeout_s: float = 5.0) -> bool:
        """Wait for the latest all-reduce and for torch to let go of its tensors; True when it has.

        Each wait is bounded by `timeout_s`; past it (a peer gone, a collective thread stuck) the tensors still held are kept
        alive for the rest of the process, so that their late release cannot need the GIL.
        Every rank calls it after its last boundary; it joins no collective."""
        last, self._last = self._last, None
        if last is None:
            return True
        work, vec = last
        last = None
        try:
            work.wait(timedelta(seconds=timeout_s))
        except Exception as exc:  # a peer is gone: the work ended in an error, which is still an end
            log.debug("boundary all-reduce ended in an error at close: %s", exc)
        del work
        lent = [vec] + [t for _, t in self._buffers.values() if t is not vec]
        counted = all(hasattr(t, "_use_count") for t in lent)  # a torch without it: keep them, don't wait
        deadline = time.monotonic() + (timeout_s if counted else 0.0)
        while True:
            # _use_count: a torch internal its stubs leave out
            held = [t for t in lent if not counted or t._use_count() > 1]  # type: ignore[attr-defined]
            if not held:
                return True
            if time.monotonic() >= deadline:
                for t in held:
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))  # never freed: no GIL needed to drop it
                log.warning(
                    "torch still holds %d boundary tensor(s) %.1f s after the last all-reduce; kept alive until exit",
                    len(held),
                    timeout_s,
                )
                return False
            time.sleep(0.001)  # hands the GIL to the collective thread that wants it
