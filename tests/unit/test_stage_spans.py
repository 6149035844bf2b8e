"""The torch pipelining integration's wrappers, without torch's schedules: instance patches that
come off and go back on, and the spans the compute wrapper emits (attrs built once per microbatch)."""

from __future__ import annotations

from parwatch.contract import HookRegistry, Observer, SpanKind
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
    assert kinds == [SpanKind.FORWARD, SpanKind.FORWARD, SpanKind.BACKWARD_INPUT, SpanKind.BACKWARD,
                     SpanKind.BACKWARD_WEIGHT]
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
            losses = [torch.tensor(rng.uniform(1, 10) * 10.0 ** rng.randint(0, spread - 1), dtype=torch.float32)
                      for _ in range(rng.randint(1, 32))]
            torch_mean = float(torch.stack(losses).to(torch.float64).mean())
            if spread == 1:
                assert _mean_loss(losses) == torch_mean
            else:  # the exactly rounded sum may differ from torch's in the last bit
                assert abs(_mean_loss(losses) - torch_mean) <= 2 * math.ulp(torch_mean)
    assert _mean_loss([torch.tensor(1.0), torch.tensor(float("nan"))]) != _mean_loss([torch.tensor(1.0)])
    assert str(_mean_loss([torch.tensor(float("nan"))])) == "nan"
