"""The check before the weights: after backward, before the optimizer step, on every rank.

One small SUM all-reduce carries, from every rank, whether its loss and its gradients are finite,
the loss of the ranks that compute one, and the squared gradient norm, so every rank knows in the
same step whether any rank saw a non-finite value and what the step's loss is. The decision is a
pure function of those sums and of state every rank keeps alike (the applied steps' losses, the
recent skips), so all ranks reach it together with no message from the sidecar: the update goes
in, or the step is re-run, skipped, or skipped and the run paused.

    check = StepCheck(rank, world_size, all_reduce_sum)
    verdict = check.run(step, measure, rerun)     # measure() -> StepReading of this rank
    if verdict.applied:
        optimizer.step()
    else:
        optimizer.zero_grad()                      # the batch is passed over

The policy (StepPolicy, the same on every rank):
- a step whose loss or gradients are not finite on some rank, or whose loss spikes (above factor x
  the median of the previous applied steps' losses), runs its forward and backward again on the
  same microbatches (`rerun`), once;
- the re-run passes: transient (a fault of the moment; the ranks that produced it are named, and the
  sidecar counts them per rank and host), the re-run's update goes in;
- the re-run fails again: persistent (non-finite again) or data-caused (the spike again), the step is
  skipped; the `pause_after_skips`-th skip within `skip_window_steps` steps pauses the run.

Only when a step is bad do the ranks join a second all-reduce, one float per rank, each writing its
own slot, which names who produced it: the ranks whose loss was not finite, else those whose
gradients were not, else those whose own loss spiked. A good step costs the one small all-reduce.

Every bad step is announced (Event.STEP_RERUN before the re-run, Event.STEP_CHECKED with the verdict
after), so an observer can move the discarded work to `wasted` and rank 0's collector can have the
leader record the decision.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parwatch.contract.boundary import AllReduceSum
from parwatch.contract.spans import Event, HookRegistry
from parwatch.contract.spans import registry as default_registry
from parwatch.vocabulary import StepAction, StepFault, Triage, jsonable

RANKS, BAD_LOSS, BAD_GRADS, LOSS_SUM, LOSS_WEIGHT, GRAD_SQ = range(6)
WIDTH = 6
_LOSS, _GRADS, _SPIKED = 1, 2, 4
"""A rank's bits in the naming all-reduce: its loss not finite, its gradients not finite, its loss spiked."""


@dataclass(frozen=True)
class StepReading:
    """What one rank saw of its step, after backward."""

    loss: float | None = None
    """This rank's loss of the step; None on a rank that computes none (not the last stage)."""
    grads_finite: bool = True
    """Whether every gradient element on this rank is finite."""
    grad_sq: float | None = None
    """This rank's squared gradient norm, as it measured it or its trainer computed it (evidence)."""


@dataclass(frozen=True)
class StepPolicy:
    """What the check does with a bad step; the same on every rank."""

    rerun: bool = True
    """Re-run a bad step once on the same microbatches to tell transient from persistent."""
    spike_factor: float | None = 3.0
    """A loss above this x the median of the previous applied steps' losses is a spike; None: not judged.
    The same factor and window as the sidecar's loss-spike rule (tests/unit/test_step_check.py)."""
    spike_window: int = 50
    """Applied steps whose losses form the spike baseline."""
    min_baseline: int = 5
    """No spike is judged before this many applied losses."""
    pause_after_skips: int = 3
    """The skip that makes this many within skip_window_steps pauses the run; 0: never pause."""
    skip_window_steps: int = 500
    """Steps over which skips are counted."""

    def __post_init__(self) -> None:
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ValueError(f"StepPolicy: spike_factor={self.spike_factor} must be > 1 (or None: no spike check)")
        if self.spike_window < 2 or self.min_baseline < 1 or self.skip_window_steps < 1:
            raise ValueError("StepPolicy: spike_window >= 2, min_baseline >= 1 and skip_window_steps >= 1")
        if self.pause_after_skips < 0:
            raise ValueError(f"StepPolicy: pause_after_skips={self.pause_after_skips} must be >= 0 (0: never)")


@dataclass(frozen=True)
class Judgement:
    """One pass of a step as every rank sees it after the check's all-reduce."""

    loss: float
    """Mean loss over the ranks that report one (NaN when none does)."""
    bad_loss: int
    """Ranks whose loss is not finite."""
    bad_grads: int
    """Ranks whose gradients are not all finite."""
    grad_sq_sum: float | None
    """The ranks' squared gradient norms summed (a parameter several ranks hold counts once per rank);
    None when no rank measured one."""
    baseline: float | None
    """The spike baseline (median of the previous applied losses), when judged."""
    fault: StepFault | None
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """Who saw what, when the step is bad: nonfinite_loss, nonfinite_grads, spiked -> ranks."""

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": jsonable(self.loss), "grad_sq_sum": jsonable(self.grad_sq_sum)}
        if self.baseline is not None:
            out["baseline"] = self.baseline
        out.update(self.ranks)
        return out


@dataclass(frozen=True)
class Verdict:
    """What every rank does with step `step`."""

    step: int
    applied: bool
    """The update goes in (the step passed, or its re-run did)."""
    loss: float
    """The loss of the pass whose update was decided: the re-run's after a re-run."""
    action: StepAction | None = None
    """None: the step passed the check."""
    fault: StepFault | None = None
    triage: Triage | None = None
    ranks: tuple[int, ...] = ()
    """The ranks that produced the fault (see the module docstring); empty when no rank can be named."""
    evidence: dict[str, Any] = field(default_factory=dict)
    batch: int | None = None
    """The batch the step trained on, as the trainer numbers its data (the data step)."""

    @property
    def pause(self) -> bool:
        return self.action == StepAction.PAUSE

    def as_dict(self) -> dict[str, Any]:
        """The verdict as Event.STEP_CHECKED carries it (JSON-safe)."""
        return {
            "step": self.step,
            "applied": self.applied,
            "action": None if self.action is None else self.action.value,
            "fault": None if self.fault is None else self.fault.value,
            "triage": None if self.triage is None else self.triage.value,
            "ranks": list(self.ranks),
            "loss": jsonable(self.loss),
            "batch": self.batch,
            "evidence": jsonable(self.evidence),
        }


class StepCheck:
    """The check before the optimizer step on one rank; `all_reduce_sum` as StepBoundary's (it may be the
    same object: the check's vector has its own width)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        all_reduce_sum: AllReduceSum,
        *,
        policy: StepPolicy | None = None,
        registry: HookRegistry = default_registry,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"StepCheck: rank={rank} must be in 0..{world_size - 1}")
        self.rank, self.world_size = rank, world_size
        self.policy = policy if policy is not None else StepPolicy()
        self.registry = registry
        self._all_reduce = all_reduce_sum
        self._losses: deque[float] = deque(maxlen=self.policy.spike_window)
        """The applied steps' losses (the spike baseline), alike on every rank."""
        self._skips: deque[int] = deque()
        """Steps skipped within the last skip_window_steps."""
        self._pending: tuple[int, Judgement, dict[str, Any], int | None] | None = None
        """The step first() found bad, until again() has the re-run's reading."""

    # ------------------------------------------------------------------------------- the step
    def run(
        self,
        step: int,
        measure: Callable[[], StepReading],
        rerun: Callable[[], None] | None = None,
        *,
        batch: int | None = None,
    ) -> Verdict:
        """Check step `step` (every rank calls it, after backward): `measure()` reads this rank's loss and
        gradients; `rerun()` runs the step's forward and backward again on the same microbatches, from
        zeroed gradients (None: a bad step is skipped untriaged)."""
        verdict = self.first(step, measure(), batch=batch, rerun=rerun is not None)
        if verdict is not None:
            return verdict
        assert rerun is not None  # first() asks for a re-run only when there is one
        rerun()
        return self.again(measure())

    def first(self, step: int, reading: StepReading, *, batch: int | None = None, rerun: bool = True) -> Verdict | None:
        """The check of a step's first pass: its verdict, or None when the step must be re-run on the same
        microbatches (Event.STEP_RERUN is out; then call `again` with the re-run's reading). For a trainer
        whose re-run cannot be a call (DeepSpeed's engine runs it as a second train_batch); `rerun=False`:
        the trainer cannot re-run, a bad step is skipped untriaged."""
        first = self._judge(reading)
        fault = first.fault
        if fault is None:
            self._applied(first.loss)
            return Verdict(step, True, first.loss, batch=batch)
        first = self._named(first, reading)
        evidence: dict[str, Any] = {"first": first.evidence()}
        if not (rerun and self.policy.rerun):
            return self._skip(step, first, Triage.UNTRIAGED, first.loss, evidence, batch)
        self._pending = (step, first, evidence, batch)
        self.registry.emit_event(Event.STEP_RERUN, step=step, fault=fault.value)
        return None

    def again(self, reading: StepReading) -> Verdict:
        """The check of the re-run `first` asked for: applied (transient) or skipped (persistent,
        data-caused), and maybe a pause."""
        if self._pending is None:
            raise RuntimeError("StepCheck.again: no step waits for its re-run (first() returned a verdict)")
        (step, first, evidence, batch), self._pending = self._pending, None
        assert first.fault is not None
        again = self._judge(reading)
        if again.fault is None:
            self._applied(again.loss)
            evidence["rerun"] = again.evidence()
            return self._announce(
                Verdict(
                    step,
                    True,
                    again.loss,
                    StepAction.RERUN,
                    first.fault,
                    Triage.TRANSIENT,
                    _origin(first),
                    evidence,
                    batch,
                )
            )
        again = self._named(again, reading)
        evidence["rerun"] = again.evidence()
        triage = Triage.PERSISTENT if again.fault == StepFault.NONFINITE else Triage.DATA_CAUSED
        return self._skip(step, first, triage, again.loss, evidence, batch, _origin(again) or _origin(first))

    @property
    def rerun_due(self) -> bool:
        """A step waits for its re-run (first() returned None)."""
        return self._pending is not None

    # ------------------------------------------------------------------------------- judging
    def _judge(self, reading: StepReading) -> Judgement:
        vec = [0.0] * WIDTH
        vec[RANKS] = 1.0
        if reading.loss is not None:
            vec[LOSS_SUM], vec[LOSS_WEIGHT] = reading.loss, 1.0
            vec[BAD_LOSS] = 0.0 if math.isfinite(reading.loss) else 1.0
        vec[BAD_GRADS] = 0.0 if reading.grads_finite else 1.0
        if reading.grad_sq is not None:
            vec[GRAD_SQ] = reading.grad_sq
        out = self._reduce(vec)
        weight = out[LOSS_WEIGHT]
        loss = out[LOSS_SUM] / weight if weight else math.nan
        bad_loss, bad_grads = int(round(out[BAD_LOSS])), int(round(out[BAD_GRADS]))
        grad_sq = out[GRAD_SQ] if out[GRAD_SQ] or not math.isfinite(out[GRAD_SQ]) else None
        baseline = self._baseline() if weight else None
        fault = None
        if bad_loss or bad_grads or (weight and not math.isfinite(loss)):
            fault = StepFault.NONFINITE
        elif (
            baseline is not None and self.policy.spike_factor is not None and loss > self.policy.spike_factor * baseline
        ):
            fault = StepFault.SPIKE
        return Judgement(loss, bad_loss, bad_grads, grad_sq, baseline, fault)

    def _named(self, judged: Judgement, reading: StepReading) -> Judgement:
        """The ranks behind a bad pass: one more all-reduce, one float per rank (every rank joins it)."""
        code = 0
        if reading.loss is not None and not math.isfinite(reading.loss):
            code |= _LOSS
        if not reading.grads_finite:
            code |= _GRADS
        line = (
            None
            if judged.baseline is None or self.policy.spike_factor is None
            else self.policy.spike_factor * judged.baseline
        )
        if line is not None and reading.loss is not None and math.isfinite(reading.loss) and reading.loss > line:
            code |= _SPIKED
        vec = [0.0] * self.world_size
        vec[self.rank] = float(code)
        codes = [int(round(c)) for c in self._reduce(vec)]
        ranks = {
            name: [r for r, c in enumerate(codes) if c & bit]
            for name, bit in (("nonfinite_loss", _LOSS), ("nonfinite_grads", _GRADS), ("spiked", _SPIKED))
        }
        return Judgement(**{**judged.__dict__, "ranks": {k: v for k, v in ranks.items() if v}})

    def _reduce(self, vec: list[float]) -> Sequence[float]:
        out = self._all_reduce(vec)
        return out() if callable(out) else out

    def _baseline(self) -> float | None:
        if self.policy.spike_factor is None or len(self._losses) < self.policy.min_baseline:
            return None
        median = statistics.median(self._losses)
        return median if median > 0 else None

    def _applied(self, loss: float) -> None:
        if math.isfinite(loss):
            self._losses.append(loss)

    # ------------------------------------------------------------------------------- skipping
    def _skip(
        self,
        step: int,
        first: Judgement,
        triage: Triage,
        loss: float,
        evidence: dict[str, Any],
        batch: int | None,
        ranks: tuple[int, ...] | None = None,
    ) -> Verdict:
        policy, skips = self.policy, self._skips
        skips.append(step)
        while skips and skips[0] <= step - policy.skip_window_steps:
            skips.popleft()
        action = StepAction.SKIP
        evidence["skipped_steps"] = list(skips)
        if policy.pause_after_skips and len(skips) >= policy.pause_after_skips:
            action = StepAction.PAUSE
            evidence["pause"] = (
                f"{len(skips)} steps skipped within {policy.skip_window_steps} steps "
                f"(pause_after_skips={policy.pause_after_skips})"
            )
            skips.clear()  # after the operator's resume, count afresh
        assert first.fault is not None
        return self._announce(
            Verdict(
                step,
                False,
                loss,
                action,
                first.fault,
                triage,
                _origin(first) if ranks is None else ranks,
                evidence,
                batch,
            )
        )

    def _announce(self, verdict: Verdict) -> Verdict:
        self.registry.emit_event(Event.STEP_CHECKED, step=verdict.step, verdict=verdict.as_dict())
        return verdict


def _origin(judged: Judgement) -> tuple[int, ...]:
    """The ranks that produced a bad pass: a non-finite loss first (it spreads to every gradient behind it),
    then non-finite gradients, then a loss that spiked."""
    for name in ("nonfinite_loss", "nonfinite_grads", "spiked"):
        if judged.ranks.get(name):
            return tuple(judged.ranks[name])
    return ()
