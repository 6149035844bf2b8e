"""Spans around one torch pipelining schedule's stages: forward, backward (input/weight), loss,
gradient reduction, and the tags that let `_p2p` time send/recv.

Everything is done by shadowing methods on the stage and schedule *instances* (never the
classes), so other schedules in the process are untouched and `undo()` restores them. The
wrappers only read arguments and time calls: numerics are unchanged.
"""

from __future__ import annotations

import time

from parwatch.contract import Span, SpanKind, registry
from parwatch.integrations._p2p import TAG
from parwatch.vocabulary import CollectiveOp, GroupRole

STAGE_METHODS = (
    "forward_one_chunk",
    "backward_one_chunk",
    "backward_weight_one_chunk",
    "perform_reduce_grad",
    "get_fwd_recv_ops",
    "get_bwd_recv_ops",
    "get_fwd_send_ops",
    "get_bwd_send_ops",
)
SCHEDULE_METHODS = ("_maybe_compute_loss",)
_P2P = {
    "get_fwd_recv_ops": ("recv", "activation"),
    "get_bwd_recv_ops": ("recv", "grad"),
    "get_fwd_send_ops": ("send", "activation"),
    "get_bwd_send_ops": ("send", "grad"),
}


class Patches:
    """Instance attributes set on objects, and how to take them away again (and put them back)."""

    def __init__(self) -> None:
        self._done: list[tuple[object, str, object]] = []
        self._made: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self._made.append((obj, name, value))
        self._apply(obj, name, value)

    def _apply(self, obj, name: str, value) -> None:
        self._done.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._done:
            obj, name, before = self._done.pop()
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)

    def redo(self) -> bool:
        """After `undo`, set the same values again (the same wrappers, whose per-microbatch attrs
        survive); False when nothing was ever set."""
        if self._done or not self._made:
            return bool(self._done)
        for obj, name, value in self._made:
            self._apply(obj, name, value)
        return True


_ABSENT = object()


def instrument_stage(stage, base: dict, patches: Patches, *, p2p: bool) -> None:
    """Wrap one stage's compute methods (and its op builders when `p2p`); `base` = stage/chunk attrs."""
    attrs_of = _AttrsByMicrobatch(base)
    patches.set(stage, "forward_one_chunk", _timed(stage.forward_one_chunk, SpanKind.FORWARD, attrs_of))
    patches.set(
        stage,
        "backward_one_chunk",
        _timed(stage.backward_one_chunk, SpanKind.BACKWARD, attrs_of, input_kind=SpanKind.BACKWARD_INPUT),
    )
    patches.set(
        stage, "backward_weight_one_chunk", _timed(stage.backward_weight_one_chunk, SpanKind.BACKWARD_WEIGHT, attrs_of)
    )
    reduce_grad = stage.perform_reduce_grad

    def perform_reduce_grad(grad_scale_factor, *args, **kwargs):
        # Gradient scaling (and FSDP's post-backward) after the last backward: not bubble. Once a step.
        with registry.span(SpanKind.DP_SYNC, **base, op="reduce_grad", scale=grad_scale_factor):
            return reduce_grad(grad_scale_factor, *args, **kwargs)

    patches.set(stage, "perform_reduce_grad", perform_reduce_grad)
    if p2p:
        for name, (op, what) in _P2P.items():
            patches.set(stage, name, _tagging(getattr(stage, name), base, op, what))


class _AttrsByMicrobatch(dict):
    """microbatch -> the attrs dict of this stage's compute spans for it, built once and shared by
    every step's spans (observers treat span attrs as read-only; compute spans carry no seq)."""

    __slots__ = ("base",)

    def __init__(self, base: dict) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, microbatch):
        attrs = self[microbatch] = {**self.base, "microbatch": microbatch}
        return attrs


_new = object.__new__
_ns = time.perf_counter_ns


def _timed(call, kind: SpanKind, attrs_of: _AttrsByMicrobatch, *, input_kind: SpanKind | None = None):
    """`call(microbatch, ...)` inside a span of `kind` (`input_kind` when called with
    full_backward=False), emitted to the registry's sinks as it ends.

    What `registry.span()` does, inlined: these calls run right after the thread wakes (a sleep,
    a blocking receive), when the CPU's caches hold other work and every Python call and object
    costs 5-10x its cost in a loop, where this costs about half a `with registry.span(...)`
    (docs/benchmarks.md, "Hook cost"): no context-manager calls, no kwargs dict, the attrs built once
    per microbatch."""
    reg = registry

    def wrapper(chunk_id, *args, **kwargs):
        if not reg.active:
            return call(chunk_id, *args, **kwargs)
        t0 = _ns()
        span = _new(Span)
        span.kind = (
            kind
            if input_kind is None or kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            else input_kind
        )
        span.attrs = attrs_of[chunk_id]
        span.parent = reg.current
        span.end = None
        span.start = reg.clock.mark()
        reg.current = span  # after start is set: an activity reporter reads both from its own thread
        reg.hook_ns += _ns() - t0  # parwatch's own cost (HookRegistry.hook_ns)
        try:
            return call(chunk_id, *args, **kwargs)
        finally:
            t0 = _ns()
            span.end = reg.clock.mark()
            reg.current = span.parent
            for on_span in reg.sinks:
                on_span(span)
            reg.hook_ns += _ns() - t0

    return wrapper


def _tagging(build, base: dict, op: str, what: str):
    """Wrap an op builder so each P2POp it returns carries `(kind, attrs)`: the span's attrs
    that do not change from step to step, built once per microbatch (`_p2p` adds peer, bytes
    and seq when the op is posted)."""
    kind = SpanKind.RECV if op == CollectiveOp.RECV else SpanKind.SEND
    tags: dict = {}

    def builder(chunk_id, *args, **kwargs):
        ops = build(chunk_id, *args, **kwargs)
        if ops and registry.active:
            tag = tags.get(chunk_id)
            if tag is None:
                tag = tags[chunk_id] = (
                    kind,
                    {**base, "microbatch": chunk_id, "op": op, "what": what, "group": GroupRole.PP, "group_size": 2},
                )
            for p2p_op in ops:
                setattr(p2p_op, TAG, tag)
        return ops

    return builder


def instrument_loss(schedule, stage_attrs: dict, patches: Patches, sink: list) -> None:
    """Time the loss, which torch computes outside the last stage's forward; keep each
    microbatch's loss tensor in `sink` (read once at the step boundary).

    The loss runs between the last stage's forward and backward, on the pipeline's critical path:
    its span takes `_timed`'s lean path (attrs built once per stage and microbatch)."""
    compute = schedule._maybe_compute_loss
    timed_by_stage: dict = {}  # stage_index -> the timed loss call of that (last) stage

    def loss_of(mb_index, stage, output, target_mbs, *args, **kwargs):  # _timed's microbatch-first order
        return compute(stage, output, target_mbs, mb_index, *args, **kwargs)

    def _maybe_compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs):
        if not (stage.is_last and schedule._loss_fn is not None):
            return compute(stage, output, target_mbs, mb_index, *args, **kwargs)
        timed = timed_by_stage.get(stage.stage_index)
        if timed is None:
            timed = timed_by_stage[stage.stage_index] = _timed(
                loss_of, SpanKind.LOSS, _AttrsByMicrobatch(stage_attrs[stage.stage_index])
            )
        before = len(schedule._internal_losses)
        result = timed(mb_index, stage, output, target_mbs, *args, **kwargs)
        if len(schedule._internal_losses) > before:
            if mb_index == 0:  # a new step: whatever step_done did not take is stale
                sink.clear()
            sink.append(schedule._internal_losses[-1].detach())  # the value only, not the graph
        return result

    patches.set(schedule, "_maybe_compute_loss", _maybe_compute_loss)
