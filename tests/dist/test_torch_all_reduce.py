"""TorchAllReduce (the boundary's all-reduce over torch.distributed) on real gloo ranks: the sums,
buffers reused across steps and widths, observers' work while it is in flight, and agree()."""

from __future__ import annotations

from tests.distutil import run_ranks


def _ranks_reduce(rank: int, world: int) -> dict:
    from parwatch.contract import BoundaryKind, HookRegistry, Observer, StepBoundary, TorchAllReduce

    reduce = TorchAllReduce()
    first = reduce([1.0, float(rank), 0.5])()
    second = reduce([2.0, 10.0 * rank, -1.0])()  # the same width: the same buffer, new values
    wider = reduce([float(rank)] * 5)()

    class Folding(Observer):
        during = 0
        boundaries = 0

        def during_boundary(self):
            self.during += 1

        def on_boundary(self, info, slots):
            self.boundaries += 1

    registry = HookRegistry()
    observer = Folding()
    registry.register(observer)
    boundary = StepBoundary(rank, world, "r", reduce, reports_loss=rank == world - 1, registry=registry)
    boundary.exchange(BoundaryKind.START, 0)
    loss, _ = boundary.exchange(BoundaryKind.STEP, 1, 2.5)
    return {
        "first": first,
        "second": second,
        "wider": wider,
        "loss": loss,
        "during": observer.during,
        "boundaries": observer.boundaries,
        "agree_all": boundary.agree(True),
        "agree_one_no": boundary.agree(rank == 0),
    }


def test_sums_across_steps_and_widths_and_lets_observers_work_meanwhile():
    results = run_ranks(_ranks_reduce, 2, timeout=120)
    for r in results:
        assert r["first"] == [2.0, 1.0, 1.0]
        assert r["second"] == [4.0, 10.0, -2.0]
        assert r["wider"] == [1.0] * 5
        assert r["loss"] == 2.5
        assert r["during"] == 2 and r["boundaries"] == 2  # once per exchange, before on_boundary
        assert r["agree_all"] is True and r["agree_one_no"] is False
