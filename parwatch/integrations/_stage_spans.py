"""Spans around one torch pipelining schedule's stages: forward, backward (input/weight), loss,
gradient reduction, and the tags that let `_p2p` time send/recv.

Everything is done by shadowing methods on the stage and schedule *instances* (never the
classes), so other schedules in the process are untouched and `undo()` restores them. The
wrappers only read arguments and time calls: numerics are unchanged.
"""

from __future__ import annotations

from parwatch.contract import SpanKind, registry
from parwatch.integrations._p2p import TAG

STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad",
                 "get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops")
SCHEDULE_METHODS = ("_maybe_compute_loss",)
_P2P = {"get_fwd_recv_ops": ("recv", "activation"), "get_bwd_recv_ops": ("recv", "grad"),
        "get_fwd_send_ops": ("send", "activation"), "get_bwd_send_ops": ("send", "grad")}


class Patches:
    """Instance attributes set on objects, and how to take them away again."""

    def __init__(self) -> None:
        self._done: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self._done.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._done:
            obj, name, before = self._done.pop()
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)


_ABSENT = object()


def instrument_stage(stage, base: dict, patches: Patches, *, p2p: bool) -> None:
    """Wrap one stage's compute methods (and its op builders when `p2p`); `base` = stage/chunk attrs.

    The wrappers run where the thread has just woken (caches cold), so each keeps to one
    `registry.span` call: no helper functions, no per-call tuples."""
    fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    reduce_grad = stage.perform_reduce_grad
    span = registry.span
    FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = (SpanKind.FORWARD, SpanKind.BACKWARD,
                                                          SpanKind.BACKWARD_INPUT, SpanKind.BACKWARD_WEIGHT)

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        if not registry.active:
            return fwd(fwd_chunk_id, *args, **kwargs)
        with span(FORWARD, **base, microbatch=fwd_chunk_id):
            return fwd(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        if not registry.active:
            return bwd(bwd_chunk_id, *args, **kwargs)
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        with span(BACKWARD if full else BACKWARD_INPUT, **base, microbatch=bwd_chunk_id):
            return bwd(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
        if not registry.active:
            return bwd_w(bwd_chunk_id, *args, **kwargs)
        with span(BACKWARD_WEIGHT, **base, microbatch=bwd_chunk_id):
            return bwd_w(bwd_chunk_id, *args, **kwargs)

    def perform_reduce_grad(grad_scale_factor, *args, **kwargs):
        # Gradient scaling (and FSDP's post-backward) after the last backward: not bubble.
        if not registry.active:
            return reduce_grad(grad_scale_factor, *args, **kwargs)
        with span(SpanKind.DP_SYNC, **base, op="reduce_grad", scale=grad_scale_factor):
            return reduce_grad(grad_scale_factor, *args, **kwargs)

    patches.set(stage, "forward_one_chunk", forward_one_chunk)
    patches.set(stage, "backward_one_chunk", backward_one_chunk)
    patches.set(stage, "backward_weight_one_chunk", backward_weight_one_chunk)
    patches.set(stage, "perform_reduce_grad", perform_reduce_grad)
    if p2p:
        for name, (op, what) in _P2P.items():
            patches.set(stage, name, _tagging(getattr(stage, name), base, op, what))


def _tagging(build, base: dict, op: str, what: str):
    """Wrap an op builder so each P2POp it returns says what it carries (read by `_p2p`, which
    builds the span's attrs when the op is posted)."""

    def builder(chunk_id, *args, **kwargs):
        ops = build(chunk_id, *args, **kwargs)
        if ops and registry.active:
            tag = (base, chunk_id, op, what)
            for p2p_op in ops:
                setattr(p2p_op, TAG, tag)
        return ops

    return builder


def instrument_loss(schedule, stage_attrs: dict, patches: Patches, sink: list) -> None:
    """Time the loss, which torch computes outside the last stage's forward; keep each
    microbatch's loss tensor in `sink` (read once at the step boundary)."""
    compute = schedule._maybe_compute_loss

    def _maybe_compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs):
        if not (stage.is_last and schedule._loss_fn is not None):
            return compute(stage, output, target_mbs, mb_index, *args, **kwargs)
        before = len(schedule._internal_losses)
        if registry.active:
            with registry.span(SpanKind.LOSS, **stage_attrs[stage.stage_index], microbatch=mb_index):
                result = compute(stage, output, target_mbs, mb_index, *args, **kwargs)
        else:
            result = compute(stage, output, target_mbs, mb_index, *args, **kwargs)
        if len(schedule._internal_losses) > before:
            if mb_index == 0:  # a new step: whatever step_done did not take is stale
                sink.clear()
            sink.append(schedule._internal_losses[-1].detach())  # the value only, not the graph
        return result

    patches.set(schedule, "_maybe_compute_loss", _maybe_compute_loss)
