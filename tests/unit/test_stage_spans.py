"""The torch pipelining integration's wrappers, without torch's schedules: instance patches that
come off and go back on, and the spans the compute wrapper emits (attrs built once per microbatch)."""

from __future__ import annotations

from parwatch.contract import HookRegistry, Observer, Span, SpanKind
from parwatch.integrations import _stage_spans as ss


class Stage:
    stage_index = 3

    def forward_one_chunk(self, chunk_id, *args, **kwargs):
        return ("forward", chunk_id)

    def backward_one_chunk(self, chunk_id, loss=None, full_backward=True, last_backward=False):
        return ("backward", chunk_id)

    def backward_weight_one_chunk(self, chunk_id, *args, **kwargs):
        return ("weight", chunk_id)

    def perform_reduce_grad(self, grad_scale_factor, *args, **kwargs):
        return None


def test_patches_undo_restores_the_class_methods_and_redo_puts_the_same_wrappers_back():
    stage, patches = Stage(), ss.Patches()
    ss.instrument_stage(stage, {"stage": 1, "chunk": 0, "vstage": 3}, patches, p2p=False)
    wrapper = stage.__dict__["forward_one_chunk"]
    patches.undo()
    assert "forward_one_chunk" not in stage.__dict__ and stage.forward_one_chunk(2) == ("forward", 2)
    assert patches.redo() is True
    assert stage.__dict__["forward_one_chunk"] is wrapper
    patches.undo()
    assert "forward_one_chunk" not in stage.__dict__
    assert ss.Patches().redo() is False


def test_compute_wrappers_emit_one_span_each_with_shared_attrs_and_the_split_backward_kind(monkeypatch):
    registry = HookRegistry()
    monkeypatch.setattr(ss, "registry", registry)
    seen = []

    class Recorder(Observer):
        def on_span(self, span):
            seen.append((span.kind, span.attrs, span.start <= span.end, registry.current))

    stage = Stage()
    ss.instrument_stage(stage, {"stage": 1, "chunk": 0, "vstage": 3}, ss.Patches(), p2p=False)
    assert stage.forward_one_chunk(0) == ("forward", 0) and seen == []  # no observer: no span
    registry.register(Recorder())
    stage.forward_one_chunk(5)
    stage.forward_one_chunk(5)
    stage.backward_one_chunk(5, full_backward=False)
    stage.backward_one_chunk(5)
    stage.backward_weight_one_chunk(5)
    kinds = [k for k, _, _, _ in seen]
    assert kinds == [
        SpanKind.FORWARD,
        SpanKind.FORWARD,
        SpanKind.BACKWARD_INPUT,
        SpanKind.BACKWARD,
        SpanKind.BACKWARD_WEIGHT,
    ]
    assert seen[0][1] == {"stage": 1, "chunk": 0, "vstage": 3, "microbatch": 5}
    assert seen[0][1] is seen[1][1]  # built once per microbatch
    assert all(ordered and current is None for _, _, ordered, current in seen)  # current restored


def test_the_step_loss_is_the_float64_mean_of_the_microbatch_losses():
    import math
    import random

    import torch

    from parwatch.integrations.torch_pipelining import _mean_loss

    rng = random.Random(3)
    for spread in (1, 9):  # microbatch losses within a decade of each other, then up to 1e9 apart
        for _ in range(500):
            losses = [
                torch.tensor(rng.uniform(1, 10) * 10.0 ** rng.randint(0, spread - 1), dtype=torch.float32)
                for _ in range(rng.randint(1, 32))
            ]
            torch_mean = float(torch.stack(losses).to(torch.float64).mean())
            if spread == 1:
                assert _mean_loss(losses) == torch_mean
            else:  # the exactly rounded sum may differ from torch's in the last bit
                assert abs(_mean_loss(losses) - torch_mean) <= 2 * math.ulp(torch_mean)
    assert _mean_loss([torch.tensor(1.0), torch.tensor(float("nan"))]) != _mean_loss([torch.tensor(1.0)])
    assert str(_mean_loss([torch.tensor(float("nan"))])) == "nan"


class Recorder(Observer):
    def __init__(self):
        self.spans = []

    def on_span(self, span):
        self.spans.append(span)


def test_the_loss_span_carries_the_stage_and_microbatch_and_the_loss_goes_to_the_sink(monkeypatch):
    import torch

    registry = HookRegistry()
    monkeypatch.setattr(ss, "registry", registry)
    recorder = Recorder()
    registry.register(recorder)

    class Schedule:
        _loss_fn = object()

        def __init__(self):
            self._internal_losses = []

        def _maybe_compute_loss(self, stage, output, target_mbs, mb_index):
            if stage.is_last:
                self._internal_losses.append(torch.tensor(float(mb_index)))
            return ("loss", mb_index)

    last, middle, schedule, sink = Stage(), Stage(), Schedule(), []
    last.is_last, middle.is_last, middle.stage_index = True, False, 1
    ss.instrument_loss(schedule, {3: {"stage": 1, "chunk": 1, "vstage": 3}}, ss.Patches(), sink)
    assert schedule._maybe_compute_loss(middle, None, None, 0) == ("loss", 0) and recorder.spans == []
    for mb in (0, 1, 0):  # microbatch 0 again: a new step, the stale losses go
        assert schedule._maybe_compute_loss(last, None, None, mb) == ("loss", mb)
    assert [s.kind for s in recorder.spans] == [SpanKind.LOSS] * 3
    assert recorder.spans[1].attrs == {"stage": 1, "chunk": 1, "vstage": 3, "microbatch": 1}
    assert recorder.spans[0].attrs is recorder.spans[2].attrs  # built once per microbatch
    assert [float(t) for t in sink] == [0.0]


def test_p2p_ops_are_posted_before_their_spans_are_built(monkeypatch):
    """Span building costs tens of microseconds right after a wake-up: it must not hold back the post
    the peer is waiting for. Marks: posted before the post, the span ends after the wait."""
    from parwatch.integrations import _p2p

    registry = HookRegistry()
    monkeypatch.setattr(_p2p, "registry", registry)
    recorder = Recorder()
    registry.register(recorder)
    at_post = []

    def post(ops, desc=None):
        at_post.append((dict(registry.sequence), registry.clock.mark()))
        return ["work"]

    monkeypatch.setitem(_p2p._originals, "_batch_p2p", post)
    monkeypatch.setitem(_p2p._originals, "_wait_batch_p2p", lambda works: None)

    class Tensor:
        nbytes = 4096

    class Op:
        peer, tensor = 1, Tensor()

    op, untagged = Op(), Op()
    setattr(op, _p2p.TAG, (SpanKind.SEND, {"stage": 0, "chunk": 0, "microbatch": 2, "op": "send"}))
    works = _p2p._batch_p2p([op, untagged])
    assert at_post[0][0] == {}  # nothing numbered yet when torch posted the ops
    assert list(works) == ["work"] and recorder.spans == []  # the span ends at the wait
    _p2p._wait_batch_p2p(works)
    (span,) = recorder.spans
    assert span.attrs == {"stage": 0, "chunk": 0, "microbatch": 2, "op": "send", "peer": 1, "bytes": 4096, "seq": 1}
    assert span.start <= at_post[0][1] <= span.end
    _p2p._wait_batch_p2p(works)  # a second wait reports nothing twice
    assert len(recorder.spans) == 1
    assert _p2p._batch_p2p([untagged]) == ["work"]  # untagged batches pass straight through


def test_a_rank_blocked_in_a_p2p_wait_shows_that_wait_as_its_activity(monkeypatch):
    """torch pipelining's waits are the rank's open span while they block: the activity reporter says
    "recv from stage 1" (the leader names the rank as waiting on its hung peer), not "between spans"."""
    from parwatch.integrations import _p2p

    registry = HookRegistry()
    monkeypatch.setattr(_p2p, "registry", registry)
    registry.register(Recorder())
    seen = []
    monkeypatch.setitem(_p2p._originals, "_batch_p2p", lambda ops, desc=None: ["send work", "recv work"])
    monkeypatch.setitem(
        _p2p._originals, "_wait_batch_p2p", lambda works: seen.append((registry.current, registry.current.parent))
    )

    class Tensor:
        nbytes = 64

    class Op:
        peer, tensor = 1, Tensor()

    send, recv = Op(), Op()
    setattr(send, _p2p.TAG, (SpanKind.SEND, {"stage": 0, "op": "send"}))
    setattr(recv, _p2p.TAG, (SpanKind.RECV, {"stage": 0, "op": "recv"}))
    outer = registry.current = Span(SpanKind.FORWARD, registry.clock.mark())
    _p2p._wait_batch_p2p(_p2p._batch_p2p([send, recv]))
    ((waiting, under),) = seen
    assert waiting.kind == SpanKind.RECV and waiting.attrs["peer"] == 1 and under is outer
    assert registry.current is outer and waiting.parent is None  # restored; the span as it was emitted
