"""The step boundary's all-reduce over torch.distributed, for StepBoundary.

One definition for every trainer that runs on torch.distributed (the reference trainer and
the torch pipelining integration). torch is imported when one is built, not when the
contract is imported, so the contract stays free of dependencies.

It is asynchronous: the call starts the all-reduce and returns a waiter, so StepBoundary
lets the observers fold the step's spans while it is in flight. On CPU the vector lives in
one array-backed tensor per width, reused every step: right after a step the caches are
cold, and there building a tensor from a list, all-reducing it (a 1-rank group) and reading
it back took 506-513 us of the training thread's CPU against 371-379 us with the array
(`benchmarks/hook_cost.py`, 3 runs, a 5 ms sleep before each call).
"""

from __future__ import annotations

from array import array
from typing import Callable


class TorchAllReduce:
    """`all_reduce_sum` for StepBoundary: a float64 SUM all-reduce of `group` (None: the world)
    on `device` (None: CPU, as gloo wants it; a CUDA device for NCCL)."""

    def __init__(self, group=None, device=None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
        self._buffers: dict[int, tuple[array, object]] = {}  # CPU: width -> (array, tensor sharing it)

    def __call__(self, values: list) -> Callable[[], list]:
        if self.device is not None:
            vec = self._torch.tensor(values, dtype=self._torch.float64, device=self.device)
            work = self._dist.all_reduce(vec, group=self.group, async_op=True)

            def result() -> list:
                work.wait()
                return vec.tolist()  # host read: the one sync a step has anyway

            return result
        buffer = self._buffers.get(len(values))
        if buffer is None:
            host = array("d", values)
            buffer = self._buffers[len(values)] = (host, self._torch.frombuffer(host, dtype=self._torch.float64))
        else:
            buffer[0][:] = array("d", values)
        host, vec = buffer
        work = self._dist.all_reduce(vec, group=self.group, async_op=True)

        def result() -> list:
            work.wait()
            return host.tolist()

        return result
