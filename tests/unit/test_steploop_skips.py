"""The integrations' step loop hands a rollback's skip_batches on: counted in data_offset from the offset the
loaded checkpoint was saved with, and given to a loader that takes a second argument (issue 42: the
Megatron-Core, DeepSpeed and torch pipelining watches passed the step alone, and nothing was skipped)."""

from __future__ import annotations

from parwatch.contract import Action, Directive, HookRegistry, Observer, StepBoundary
from parwatch.integrations._steploop import StepLoop

RUN = "run-skips"


class Sidecar(Observer):
    """Offers one directive at rank 0's next boundary, as the collector offers the sidecar's."""

    def __init__(self) -> None:
        self.offer: Directive | None = None

    def pending_directive(self):
        offer, self.offer = self.offer, None
        return offer


def loop(loader) -> tuple[StepLoop, Sidecar]:
    registry = HookRegistry()
    sidecar = Sidecar()
    registry.register(sidecar)
    boundary = StepBoundary(0, 1, RUN, lambda v: v, reports_loss=True, registry=registry)  # one rank: the sum is v
    steps = StepLoop(pp_rank=0, boundary=boundary, load_checkpoint=loader)
    steps.begin(0, {}, {})
    return steps, sidecar


def rollback(steps: StepLoop, sidecar: Sidecar, directive_id: int, to_step: int, skip: int) -> int:
    sidecar.offer = Directive(directive_id, Action.ROLLBACK, RUN, to_step=to_step, skip_batches=skip)
    return steps.boundary_step(1.0)


def test_data_offset_counts_skipped_batches_from_the_offset_the_checkpoint_was_saved_with():
    loaded: list = []
    steps, sidecar = loop(lambda step: loaded.append(step) or step)
    for _ in range(4):
        steps.boundary_step(1.0)
        steps.checkpoint_saved(steps.step)
    assert rollback(steps, sidecar, 1, 2, skip=3) == 2 and steps.data_offset == 3  # step 3 trains batch 6
    for _ in range(3):
        steps.boundary_step(1.0)
        steps.checkpoint_saved(steps.step)  # 3, 4, 5 saved with offset 3
    assert rollback(steps, sidecar, 2, 4, skip=2) == 4 and steps.data_offset == 5
    assert rollback(steps, sidecar, 3, 1, skip=1) == 1 and steps.data_offset == 1  # 1 was saved before any skip
    assert loaded == [2, 4, 1]


def test_a_loader_that_takes_two_arguments_is_handed_skip_batches():
    calls: list = []

    def load(step, skip_batches):
        calls.append((step, skip_batches))
        return step

    steps, sidecar = loop(load)
    for _ in range(3):
        steps.boundary_step(1.0)
        steps.checkpoint_saved(steps.step)
    rollback(steps, sidecar, 1, 2, skip=4)
    assert calls == [(2, 4)] and steps.data_offset == 4


def test_settle_after_the_last_step_applies_what_the_last_steps_brought():
    """A rollback decided on the last steps comes at the settling boundary; training goes on from it."""
    settled: list = []

    class Settling(Sidecar):
        def settle(self, step, timeout_s):
            settled.append(step)
            self.offer = Directive(1, Action.ROLLBACK, RUN, to_step=2, skip_batches=1) if len(settled) == 1 else None

    registry = HookRegistry()
    registry.register(sidecar := Settling())
    boundary = StepBoundary(0, 1, RUN, lambda v: v, reports_loss=True, registry=registry)
    steps = StepLoop(pp_rank=0, boundary=boundary, load_checkpoint=lambda step: step)
    steps.begin(0, {}, {})
    for _ in range(3):
        steps.boundary_step(1.0)
        steps.checkpoint_saved(steps.step)
    assert steps.boundary_step(1.0, last=True) == 2 and steps.data_offset == 1
    assert steps.boundary_step(1.0) == 3 and settled == [4]
    assert steps.boundary_step(1.0, last=True) == 4 and settled == [4, 4] and sidecar.offer is None
