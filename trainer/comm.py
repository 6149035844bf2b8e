"""Every byte the trainer moves between ranks goes through this module.

Each call is announced as a hook span (op, group role, bytes, group size), so
an observer sees every collective and point-to-point transfer without the
trainer knowing it is watched. Injected collective slowness also lives here.

Sends are posted non-blocking (isend) and completed later: a blocking send
would make the sender wait for a busy receiver, and the idle time that adds is
the trainer's fault, not the pipeline's (DESIGN.md). Receives block: the data
is needed to go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer import hooks
from trainer.parallel_dims import ProcessGroups

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class _PendingSend:
    work: object
    tensor: torch.Tensor  # kept alive until the transfer completes
    start: object
    attrs: dict
    end: object = None


@dataclass
class Comm:
    groups: ProcessGroups
    slow_ms: dict = field(default_factory=dict)
    """Injected extra latency per collective, by group role ("tp", "pp", "dp")."""
    registry: hooks.HookRegistry = hooks.registry
    faults: object = None
    """trainer.faults.Faults whose hang points sit here (set by the executor), or None."""
    _pending: list = field(default_factory=list)

    # ---------------------------------------------------------------- groups
    def size(self, role: str) -> int:
        return {"tp": self.groups.dims.tp, "pp": self.groups.dims.pp, "dp": self.groups.dims.dp}.get(
            role, self.groups.dims.world_size
        )

    def _group(self, role: str):
        return None if role == "world" else getattr(self.groups, role)

    def _delay(self, role: str) -> None:
        ms = self.slow_ms.get(role)
        if ms:
            time.sleep(ms / 1000.0)

    # ----------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, role: str, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce over the group `role`; a no-op on a group of one."""
        n = self.size(role)
        if n == 1:
            return tensor
        if self.faults is not None and role == "tp":
            self.faults.hang_if("collective")  # blocks before entering: its peers wait in seq k, it is not there
        with self.registry.span(
            hooks.COLLECTIVE, op="all_reduce", group=role, bytes=tensor.numel() * tensor.element_size(), group_size=n
        ):
            self._delay(role)
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self._group(role))
        return tensor

    # -------------------------------------------------------- point to point
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, **attrs) -> None:
        """Post a send to global rank `dst`; completed by `complete_sends()`."""
        tensor = tensor.contiguous()
        if self.faults is not None and self.faults.hang_due("send"):
            with self.registry.span(hooks.SEND, peer=dst, op="send", group="pp", **attrs):
                self.faults.hang_if("send")  # the rank reads as stuck in a send to dst
        active = self.registry.active
        start = self.registry.mark() if active else None
        self._delay("pp")
        work = dist.isend(tensor, dst=dst, group=self.groups.pp, tag=tag)
        span_attrs = None
        if active:
            span_attrs = dict(attrs, peer=dst, op="send", group="pp", bytes=tensor.numel() * tensor.element_size(), group_size=2)
        self._pending.append(_PendingSend(work, tensor, start, span_attrs))

    def recv(self, tensor: torch.Tensor, src: int, tag: int, **attrs) -> torch.Tensor:
        with self.registry.span(
            hooks.RECV, peer=src, op="recv", group="pp", bytes=tensor.numel() * tensor.element_size(), group_size=2, **attrs
        ):
            self._delay("pp")
            dist.recv(tensor, src=src, group=self.groups.pp, tag=tag)
        return tensor

    def poll_sends(self) -> None:
        """Stamp the completion time of sends that have finished (cheap; only when observed)."""
        if not self.registry.active:
            return
        for p in self._pending:
            if p.end is None and p.work.is_completed():
                p.end = self.registry.mark()

    def complete_sends(self) -> None:
        """Wait for every posted send; report each as a span from post to completion."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.work.wait()
            if p.attrs is not None:
                end = p.end if p.end is not None else self.registry.mark()
                self.registry.emit_span(hooks.SEND, p.start, end, **p.attrs)
