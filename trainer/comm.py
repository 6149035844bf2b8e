"""Every byte the trainer moves between ranks goes through this module.

Each call is announced as a hook span (op, group role, bytes, group size), so
an observer sees every collective and point-to-point transfer without the
trainer knowing it is watched. Injected collective slowness also lives here.

Every span carries `seq` (the contract's registry numbers it: collectives per
group role; p2p per direction and peer, so the k-th send from A to B is the k-th
receive at B from A; a send takes its number when posted), and collectives carry
`ranks`, the group's global ranks. All members of a group make the same calls in
the same order, so (group, seq) names one collective instance on every member: an
observer can line the members' spans up and tell the last arrival's transfer from
everyone else's waiting.

Sends are posted non-blocking (isend) and completed later: a blocking send
would make the sender wait for a busy receiver, and the idle time that adds is
the trainer's fault, not the pipeline's (DESIGN.md). Receives block: the data
is needed to go on.

A send's completion is stamped when it completes, not when the training thread
next looks: with a host clock, a per-destination lane thread waits on each send
in posting order (sends to one peer complete in order) and takes the mark. A
slow-link fault also lives in that lane: the send is posted by the training
thread (its span starts then) and leaves the lane X ms later, as if the link
took that long, so the delay is inside the transfer, not before the post.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parwatch import contract
from parwatch.trainer.parallel_dims import ProcessGroups
from parwatch.vocabulary import CollectiveOp, GroupRole

if TYPE_CHECKING:
    from parwatch.trainer.faults import Faults

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class _PendingSend:
    work: dist.Work | None
    """None only until a lane posts it."""
    tensor: torch.Tensor  # kept alive until the transfer completes
    start: Any
    """Clock mark when posted (None when nobody observes)."""
    attrs: dict[str, Any] | None
    """The send span's attrs; None when nobody observes."""
    end: Any = None
    lane: bool = False
    """Posted and stamped by a lane thread (then `done` is set once `work` completed or failed)."""
    done: threading.Event | None = None
    error: BaseException | None = None


class _SendLane:
    """Sends to one destination, in posting order: post (after an injected link delay), wait, stamp."""

    def __init__(self, comm: Comm, dst: int, delay_s: float):
        self.comm, self.dst, self.delay_s = comm, dst, delay_s
        self._queue: queue.SimpleQueue[tuple[_PendingSend, int, float] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"send-lane-{dst}", daemon=True)
        self._thread.start()

    def put(self, p: _PendingSend, tag: int, posted_at: float) -> None:
        self._queue.put((p, tag, posted_at))

    def close(self, timeout_s: float) -> bool:
        """Stop after the sends already queued; True when the thread has ended."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        comm = self.comm
        while True:
            item = self._queue.get()
            if item is None:
                return
            p, tag, posted_at = item
            try:
                if self.delay_s:
                    remaining = posted_at + self.delay_s - time.perf_counter()
                    if remaining > 0:
                        time.sleep(remaining)
                if p.work is None:
                    p.work = dist.isend(p.tensor, dst=self.dst, group=comm.groups.pp, tag=tag)
                assert p.work is not None, "isend returns None only to a rank outside the group"
                p.work.wait()
                if p.attrs is not None:
                    p.end = comm.registry.clock.mark()
            except Exception as exc:  # the training thread raises it (complete_sends)
                p.error = exc
            finally:
                assert p.done is not None  # every lane send has one
                p.done.set()


@dataclass
class Comm:
    groups: ProcessGroups
    slow_ms: dict[str, float] = field(default_factory=dict)
    """Injected extra latency per collective, by group role ("tp", "pp", "dp")."""
    registry: contract.HookRegistry = contract.registry
    link_delay_ms: dict[int, float] = field(default_factory=dict)
    """Injected slow links: destination global rank -> extra ms inside each send to it."""
    faults: Faults | None = None
    """The faults whose hang points sit here (set by the executor), or None."""
    _pending: list[_PendingSend] = field(default_factory=list)
    _ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _lanes: dict[int, _SendLane] = field(default_factory=dict)

    # ---------------------------------------------------------------- groups
    def size(self, role: GroupRole) -> int:
        return {"tp": self.groups.dims.tp, "pp": self.groups.dims.pp, "dp": self.groups.dims.dp}.get(
            role, self.groups.dims.world_size
        )

    def _group(self, role: str) -> dist.ProcessGroup | None:
        return None if role == GroupRole.WORLD else getattr(self.groups, role)

    def group_ranks(self, role: str) -> tuple[int, ...]:
        """The global ranks of this rank's `role` group (one shared tuple per role)."""
        ranks = self._ranks.get(role)
        if ranks is None:
            listed = getattr(self.groups, f"{role}_ranks", None)
            ranks = self._ranks[role] = tuple(listed) if listed else tuple(range(self.groups.dims.world_size))
        return ranks

    def _delay(self, role: GroupRole) -> None:
        ms = self.slow_ms.get(role)
        if ms:
            time.sleep(ms / 1000.0)

    # ----------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, role: GroupRole, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce over the group `role`; a no-op on a group of one."""
        n = self.size(role)
        if n == 1:
            return tensor
        if self.faults is not None and role == GroupRole.TP:
            self.faults.hang_if("collective")  # blocks before entering: its peers wait in seq k, it is not there
        with self.registry.span(
            contract.SpanKind.COLLECTIVE,
            op=CollectiveOp.ALL_REDUCE,
            group=role,
            bytes=tensor.numel() * tensor.element_size(),
            group_size=n,
            ranks=self.group_ranks(role),
        ):
            self._delay(role)
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self._group(role))
        return tensor

    # -------------------------------------------------------- point to point
    def _lane(self, dst: int) -> _SendLane | None:
        """The lane for sends to `dst`, when one is needed: a slow link, or a host clock to stamp with."""
        lane = self._lanes.get(dst)
        if lane is None:
            delay_ms = self.link_delay_ms.get(dst, 0.0)
            host_clock = self.registry.active and not getattr(self.registry.clock, "resolves_at_boundary", False)
            if not delay_ms and not host_clock:
                return None
            lane = self._lanes[dst] = _SendLane(self, dst, delay_ms / 1000.0)
        return lane

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, **attrs: Any) -> None:
        """Post a send to global rank `dst`; completed by `complete_sends()`."""
        tensor = tensor.contiguous()
        if self.faults is not None and self.faults.hang_due("send"):
            with self.registry.span(
                contract.SpanKind.SEND, peer=dst, op=CollectiveOp.SEND, group=GroupRole.PP, **attrs
            ):
                self.faults.hang_if("send")  # the rank reads as stuck in a send to dst
        active = self.registry.active
        start = self.registry.mark() if active else None
        posted_at = time.perf_counter()
        self._delay(GroupRole.PP)
        span_attrs = None
        if active:
            span_attrs = dict(
                attrs,
                peer=dst,
                op=CollectiveOp.SEND,
                group=GroupRole.PP,
                bytes=tensor.numel() * tensor.element_size(),
                group_size=2,
            )
            span_attrs["seq"] = self.registry.next_seq(contract.SpanKind.SEND, span_attrs)  # numbered when posted
        lane = self._lane(dst)
        if lane is None:
            work = dist.isend(tensor, dst=dst, group=self.groups.pp, tag=tag)
            self._pending.append(_PendingSend(work, tensor, start, span_attrs))
            return
        p = _PendingSend(None, tensor, start, span_attrs, lane=True, done=threading.Event())
        if not lane.delay_s:  # post now, from the training thread, as without a lane
            p.work = dist.isend(tensor, dst=dst, group=self.groups.pp, tag=tag)
        self._pending.append(p)
        lane.put(p, tag, posted_at)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, **attrs: Any) -> torch.Tensor:
        if self.faults is not None and self.faults.hang_due("recv"):
            with self.registry.span(
                contract.SpanKind.RECV, peer=src, op=CollectiveOp.RECV, group=GroupRole.PP, **attrs
            ):
                self.faults.hang_if("recv")  # in its receive from src, whose send is posted: the data never lands
        with self.registry.span(
            contract.SpanKind.RECV,
            peer=src,
            op=CollectiveOp.RECV,
            group=GroupRole.PP,
            bytes=tensor.numel() * tensor.element_size(),
            group_size=2,
            **attrs,
        ):
            self._delay(GroupRole.PP)
            dist.recv(tensor, src=src, group=self.groups.pp, tag=tag)
        return tensor

    def poll_sends(self) -> None:
        """Stamp the completion time of sends that have finished (device clocks; lanes stamp their own)."""
        if not self.registry.active:
            return
        for p in self._pending:
            if p.end is None and not p.lane and p.work is not None and p.work.is_completed():
                p.end = self.registry.mark()

    def close(self, failed: bool = False, timeout_s: float = 5.0) -> None:
        """Shutdown, before the process group is destroyed: complete posted sends (not after a
        failure: a peer may be gone), then end the lanes.

        A lane thread holds this Comm and so the process groups: left running, it keeps them alive
        into interpreter exit, where torch's threads must not be doing anything."""
        try:
            if not failed:
                self.complete_sends()
        finally:
            lanes, self._lanes = self._lanes, {}
            for lane in lanes.values():
                lane.close(timeout_s)

    def complete_sends(self) -> None:
        """Wait for every posted send; report each as a span from post to completion."""
        pending, self._pending = self._pending, []
        for p in pending:
            if p.lane:  # gloo counts completions: a second wait() on one send would block forever
                assert p.done is not None  # every lane send has one
                p.done.wait()
                if p.error is not None:
                    raise p.error
            else:
                assert p.work is not None, "isend returns None only to a rank outside the group"
                p.work.wait()
            if p.attrs is not None:
                end = p.end if p.end is not None else self.registry.mark()
                self.registry.emit_span(contract.SpanKind.SEND, p.start, end, **p.attrs)
