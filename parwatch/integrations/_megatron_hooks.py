"""The Megatron-Core module attributes parwatch wraps while a MegatronWatch is attached.

Megatron's schedules look these up as module globals at call time, so replacing them reaches
every schedule without editing Megatron; `uninstall` puts the originals back (leaving anything
patched over ours alone). No torch attribute is touched.

- schedules.forward_step: a forward span per (chunk, microbatch), from its `vp_stage` and
  `current_microbatch` kwargs; the tensor it returns is remembered (weakly, by identity);
- schedules.forward_step_calc_loss: ends the forward span and times the loss (last stage);
- schedules.backward_step: a backward span, named by the identity of the output tensor it is
  handed (the very object forward_step returned);
- p2p_communication._batched_p2p_ops / _p2p_ops: the works they return are wrapped so each send
  span runs from posting to the end of the first wait on it, each receive from entering the wait
  to its end. A send is named by the tensor it sends (a forward's output or a backward's input
  gradient); a receive by the forward or backward that consumes the buffer it filled, and is
  emitted once both are known;
- tensor_parallel.mappings' _reduce, _gather_along_*_dim and _reduce_scatter_along_*_dim (tp > 1):
  a collective span (group "tp") per call on the tensor-parallel group, nested in its forward or
  backward. Megatron's linear layers also call torch.distributed directly (the column-parallel
  input-gradient all-reduce, sequence-parallel gathers inside the layer): those are not seen;
- schedules.forward_backward_*: the step context; `forward_only=True` (evaluation) runs
  unobserved. `get_forward_backward_func()` returns the wrapped functions while attached.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from parwatch.contract import Span, SpanKind, registry
from parwatch.vocabulary import CollectiveOp, GroupRole

FORWARD_BACKWARD = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
SCHEDULE_FUNCS = ("forward_step", "forward_step_calc_loss", "backward_step", *FORWARD_BACKWARD)
P2P_FUNCS = ("_batched_p2p_ops", "_p2p_ops")
TP_FUNCS = {
    "_reduce": CollectiveOp.ALL_REDUCE,
    "_gather_along_last_dim": CollectiveOp.ALL_GATHER,
    "_gather_along_first_dim": CollectiveOp.ALL_GATHER,
    "_reduce_scatter_along_first_dim": CollectiveOp.REDUCE_SCATTER,
    "_reduce_scatter_along_last_dim": CollectiveOp.REDUCE_SCATTER,
}

_new = object.__new__
_RECV, _SEND = SpanKind.RECV, SpanKind.SEND


def _first(x):
    """The tensor of a tensor-or-list (Megatron wraps single tensors in lists here and there)."""
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x


class Hooks:
    """One rank's wrappers and what they share within a step (see the module docstring).

    chunk_of: id(model chunk) -> its index on this rank (non-interleaved calls pass no vp_stage).
    pp_rank, pp: this rank's pipeline position and the pipeline's size (vstage = chunk * pp + pp_rank)."""

    def __init__(
        self, chunk_of: dict[int, int], pp_rank: int, pp: int, *, p2p: bool = True, tp_group=None, tp_ranks=()
    ) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.chunk_of, self.pp_rank, self.pp, self.p2p = chunk_of, pp_rank, pp, p2p
        self.tp_group, self.tp_ranks = tp_group, list(tp_ranks)
        self._attrs: dict[tuple[int, int], dict] = {}
        self._owner: Any = WeakIdKeyDictionary()  # tensor -> compute attrs of the action that made it
        self._recv: Any = WeakIdKeyDictionary()  # receive buffer -> its span, until a compute consumes it
        self._open_recv: list[Span] = []  # this step's receive spans not emitted yet
        self._unwaited: list[_TimedWork] = []  # this step's works no wait has ended yet
        self._forward: Span | None = None  # the forward span forward_step opened, until the loss starts
        self.computes = 0  # forward and backward calls so far: tells whether a compute ran between two waits
        self._eval = 0  # depth of forward_only calls: nothing is observed inside
        self._counts: dict[tuple[str, int], int] = {}  # microbatch counters, for calls that name none
        self.losses: list = []  # the step's scaled microbatch losses (detached), for step_done
        self._originals: dict[tuple[object, str], Any] = {}

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        from megatron.core.pipeline_parallel import p2p_communication, schedules
        from megatron.core.tensor_parallel import mappings

        targets = [(schedules, name) for name in SCHEDULE_FUNCS]
        if self.p2p:
            targets += [(p2p_communication, name) for name in P2P_FUNCS]
        if self.tp_group is not None and len(self.tp_ranks) > 1:
            targets += [(mappings, name) for name in TP_FUNCS]
        missing = [f"{m.__name__}.{n}" for m, n in targets if not callable(getattr(m, n, None))]
        if missing:
            raise AttributeError(f"megatron-core lacks {', '.join(missing)}")
        if any(hasattr(getattr(m, n), "_parwatch_hooks") for m, n in targets):
            raise RuntimeError("another MegatronWatch is attached in this process: close or detach it first")
        for module, name in targets:
            original = getattr(module, name)
            self._originals[(module, name)] = original
            setattr(module, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            current = getattr(module, name, None)
            if getattr(current, "_parwatch_hooks", None) is self:
                setattr(module, name, original)
        self._originals.clear()
        self._reset_step()

    def _wrap(self, name: str, original):
        if name in FORWARD_BACKWARD:
            make = self._forward_backward
        elif name in TP_FUNCS:
            make = partial(self._tp_collective, TP_FUNCS[name])
        else:
            make = {
                "forward_step": self._forward_step,
                "forward_step_calc_loss": self._calc_loss,
                "backward_step": self._backward_step,
                "_batched_p2p_ops": self._p2p_batched,
                "_p2p_ops": self._p2p_dict,
            }[name]
        wrapper = make(original)
        wrapper._parwatch_hooks = self
        wrapper.__wrapped__ = original
        wrapper.__name__ = getattr(original, "__name__", name)
        return wrapper

    # ------------------------------------------------------------------ attrs
    def attrs(self, chunk: int, microbatch: int) -> dict:
        """The compute spans' attrs of (chunk, microbatch), built once and shared by every step."""
        key = (chunk, microbatch)
        a = self._attrs.get(key)
        if a is None:
            a = self._attrs[key] = {
                "stage": self.pp_rank,
                "chunk": chunk,
                "vstage": chunk * self.pp + self.pp_rank,
                "microbatch": microbatch,
            }
        return a

    def _next(self, kind: str, chunk: int) -> int:
        n = self._counts.get((kind, chunk), 0)
        self._counts[(kind, chunk)] = n + 1
        return n

    def _reset_step(self) -> None:
        if self._unwaited:  # sends the schedule never waited for: complete by the step's end at the latest
            end = registry.clock.mark()
            for work in self._unwaited:
                for span in work.close():
                    if span.kind is _SEND:  # a receive never waited for has no wait to time
                        span.start, span.end = work._posted, end
                        registry.emit(span)
            self._unwaited.clear()
        for span in self._open_recv:  # received but never consumed by a watched compute: emit as is
            if span.end is not None:
                if span.attrs.get("microbatch") is None:
                    span.attrs = {**span.attrs, "stage": self.pp_rank}
                registry.emit(span)
        self._open_recv.clear()
        self._recv.clear()
        self._owner.clear()
        self._counts.clear()
        self._forward = None

    # ------------------------------------------------------------------ step context
    def _forward_backward(self, original):
        def forward_backward(*args, **kwargs):
            if kwargs.get("forward_only", False):
                self._eval += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self._eval -= 1
            self._reset_step()
            try:
                return original(*args, **kwargs)
            finally:
                self._reset_step()

        return forward_backward

    # ------------------------------------------------------------------ compute
    def _forward_step(self, original):
        reg = registry

        def forward_step(*args, **kwargs):
            if not reg.active or self._eval:
                return original(*args, **kwargs)
            model = args[2] if len(args) > 2 else kwargs.get("model")
            vp = kwargs.get("vp_stage")
            chunk = vp if vp is not None else self.chunk_of.get(id(model), 0)
            mb = kwargs.get("current_microbatch")
            if mb is None:
                mb = self._next("F", chunk)
            attrs = self.attrs(chunk, mb)
            self._consumed(args[4] if len(args) > 4 else kwargs.get("input_tensor"), attrs)
            span = _new(Span)
            self.computes += 1
            span.kind, span.attrs, span.parent, span.end = SpanKind.FORWARD, attrs, reg.current, None
            span.start = reg.clock.mark()
            reg.current = span
            self._forward = span
            try:
                result = original(*args, **kwargs)
            finally:
                if self._forward is span:  # the loss hook did not end it (no loss step ran)
                    self._end_forward(span)
            out = _first(result[0]) if isinstance(result, tuple) else None
            if out is not None:
                self._owner[out] = attrs
            return result

        return forward_step

    def _end_forward(self, span: Span) -> None:
        reg = registry
        span.end = reg.clock.mark()
        reg.current = span.parent
        self._forward = None
        for on_span in reg.sinks:
            on_span(span)

    def _calc_loss(self, original):
        reg = registry

        def forward_step_calc_loss(*args, **kwargs):
            forward = self._forward
            if forward is None:  # not inside a watched forward_step
                return original(*args, **kwargs)
            self._end_forward(forward)
            loss_func = args[2] if len(args) > 2 else kwargs.get("loss_func")
            collect = args[5] if len(args) > 5 else kwargs.get("collect_non_loss_data", False)
            last = args[9] if len(args) > 9 else kwargs.get("is_last_stage")
            if last is None:
                from megatron.core import parallel_state

                vp = args[4] if len(args) > 4 else kwargs.get("vp_stage")
                last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            if not last or loss_func is None or collect:
                return original(*args, **kwargs)
            span = _new(Span)
            span.kind, span.attrs, span.parent, span.end = SpanKind.LOSS, forward.attrs, reg.current, None
            span.start = reg.clock.mark()
            reg.current = span
            try:
                result = original(*args, **kwargs)
            finally:
                span.end = reg.clock.mark()
                reg.current = span.parent
                for on_span in reg.sinks:
                    on_span(span)
            loss = _first(result[0])
            if loss is not None and hasattr(loss, "detach"):
                self.losses.append(loss.detach())
            return result

        return forward_step_calc_loss

    def _backward_step(self, original):
        reg = registry

        def backward_step(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs):
            if not reg.active or self._eval:
                return original(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs)
            out = _first(output_tensor)
            attrs = self._owner.get(out) if out is not None else None
            if attrs is None:  # a forward this watch did not see: count in the first chunk
                attrs = self.attrs(0, self._next("B", 0))
            self._consumed(output_tensor_grad, attrs)
            span = _new(Span)
            self.computes += 1
            span.kind, span.attrs, span.parent, span.end = SpanKind.BACKWARD, attrs, reg.current, None
            span.start = reg.clock.mark()
            reg.current = span
            try:
                grad = original(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs)
            finally:
                span.end = reg.clock.mark()
                reg.current = span.parent
                for on_span in reg.sinks:
                    on_span(span)
            g = _first(grad)
            if g is not None:
                self._owner[g] = attrs
            return grad

        return backward_step

    # ------------------------------------------------------------------ tensor parallel
    def _tp_collective(self, op: str, original):
        reg = registry

        def collective(input_, group=None, *args, **kwargs):
            if not reg.active or self._eval or group is not self.tp_group:
                return original(input_, group, *args, **kwargs)
            nbytes = input_.nbytes
            with reg.span(
                SpanKind.COLLECTIVE,
                op=op,
                group=GroupRole.TP,
                bytes=nbytes,
                group_size=len(self.tp_ranks),
                ranks=self.tp_ranks,
                stage=self.pp_rank,
            ):
                return original(input_, group, *args, **kwargs)

        return collective

    # ------------------------------------------------------------------ point to point
    def _consumed(self, tensors, attrs: dict) -> None:
        """A compute takes received buffers as input: their receive spans get its names."""
        if not self._recv:
            return
        for t in tensors if isinstance(tensors, (list, tuple)) else (tensors,):
            if t is None:
                continue
            span = self._recv.pop(t, None)
            if span is None:
                continue
            span.attrs = {**span.attrs, **attrs}
            if span.end is not None:
                self._emit_recv(span)

    def _emit_recv(self, span: Span) -> None:
        try:
            self._open_recv.remove(span)
        except ValueError:
            return
        registry.emit(span)

    def _spans(self, kw: dict) -> list[tuple[str, Span]]:
        """The send/recv spans of one p2p call, keyed like _p2p_ops' works, in _batched_p2p_ops' op order."""
        reg = registry
        out = []
        for key, tensor, peer_key, kind, what in (
            ("send_prev", kw.get("tensor_send_prev"), "prev_pipeline_rank", _SEND, "grad"),
            ("recv_prev", kw.get("tensor_recv_prev"), "prev_pipeline_rank", _RECV, "activation"),
            ("send_next", kw.get("tensor_send_next"), "next_pipeline_rank", _SEND, "activation"),
            ("recv_next", kw.get("tensor_recv_next"), "next_pipeline_rank", _RECV, "grad"),
        ):
            if tensor is None:
                continue
            owner = self._owner.get(tensor) if kind is _SEND else None
            attrs = {
                **(owner if owner is not None else {"stage": self.pp_rank}),
                "op": CollectiveOp.SEND if kind is _SEND else CollectiveOp.RECV,
                "what": what,
                "group": GroupRole.PP,
                "group_size": 2,
                "peer": kw.get(peer_key),
                "bytes": tensor.nbytes,
            }
            attrs["seq"] = reg.next_seq(kind, attrs)  # numbered when posted: the program's order
            span = _new(Span)
            span.kind, span.attrs, span.parent, span.end = kind, attrs, None, None
            if kind is _RECV:
                self._recv[tensor] = span
                self._open_recv.append(span)
            out.append((key, span))
        return out

    def _p2p_batched(self, original):
        reg = registry

        def _batched_p2p_ops(**kwargs):
            if not reg.active or self._eval:
                return original(**kwargs)
            posted = reg.clock.mark()
            works = original(**kwargs)
            spans = [span for _, span in self._spans(kwargs)]
            if not spans or not works:
                return works
            batch = _Batch(spans)
            if len(works) == len(spans):  # one work per op (gloo)
                return [_TimedWork(w, [s], posted, self, batch) for w, s in zip(works, spans)]
            # coalesced (NCCL): one work for the whole batch, every op ends with it
            return [_TimedWork(w, spans, posted, self, batch) for w in works[:1]] + list(works[1:])

        return _batched_p2p_ops

    def _p2p_dict(self, original):
        reg = registry

        def _p2p_ops(**kwargs):
            if not reg.active or self._eval:
                return original(**kwargs)
            posted = reg.clock.mark()
            works = original(**kwargs)
            keyed = self._spans(kwargs)
            batch = _Batch([span for _, span in keyed])
            for key, span in keyed:
                if key in works:
                    works[key] = _TimedWork(works[key], [span], posted, self, batch)
            return works

        return _p2p_ops


class _Batch:
    """The works of one p2p call. A receive's span starts at the first wait on any of them when no
    compute ran since: gloo's send completes only once the peer posts its receive, so a rank that
    waits on its send first is blocked there for the data it then receives at once."""

    __slots__ = ("first", "computes", "recv")

    def __init__(self, spans=()) -> None:
        self.first = None
        self.computes = -1
        self.recv = next((span for span in spans if span.kind is _RECV), None)
        """The call's first receive: what a rank blocked in any of its waits is waiting for."""


class _TimedWork:
    """A torch distributed work whose first `wait()` ends its spans (everything else passes through)."""

    __slots__ = ("_work", "_spans", "_posted", "_hooks", "_batch")

    def __init__(self, work, spans: list[Span], posted, hooks: Hooks, batch: _Batch) -> None:
        self._work, self._spans, self._posted, self._hooks, self._batch = work, spans, posted, hooks, batch
        hooks._unwaited.append(self)

    def close(self) -> list[Span]:
        """Its spans, if no wait has ended them (then never again)."""
        spans, self._spans = self._spans, []
        return spans

    def wait(self, *args, **kwargs):
        spans = self._spans
        if not spans:
            return self._work.wait(*args, **kwargs)
        mark = registry.clock.mark
        start = mark()
        batch, computes = self._batch, self._hooks.computes
        if batch.first is None or batch.computes != computes:
            batch.first, batch.computes = start, computes
        # While it blocks, the rank is in this transfer: the activity reporter reads registry.current,
        # so a hang shows this rank waiting on its peer. The call's receive while it is open (gloo
        # blocks a send's wait until the peer posts its receive: the rank waits for that peer's data).
        waiting = batch.recv if batch.recv is not None and batch.recv.end is None else spans[0]
        waiting.start = start
        reg = registry
        outer, reg.current = reg.current, waiting
        try:
            result = self._work.wait(*args, **kwargs)
        finally:
            reg.current = outer
        end = mark()
        self._spans = []
        try:
            self._hooks._unwaited.remove(self)
        except ValueError:
            pass
        for span in spans:
            span.end = end
            if span.kind is _RECV:
                span.start = batch.first
                if span.attrs.get("microbatch") is not None:  # its consumer already named it
                    self._hooks._emit_recv(span)
            else:
                span.start = self._posted
                registry.emit(span)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def mean_loss(losses: list) -> float | None:
    """The step's loss from the microbatch losses Megatron backpropagates (each already divided by
    the number of microbatches): their sum."""
    if not losses:
        return None
    if losses[0].device.type == "cpu":
        return math.fsum(map(float, losses))
    import torch

    return float(torch.stack([t.reshape(()) for t in losses]).to(torch.float64).sum())
