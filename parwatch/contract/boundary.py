"""The step boundary: one small SUM all-reduce on the world group, every step.

Every rank contributes one float64 vector of the same width, and the width does not
depend on the world size: a value only one rank knows is written by that rank alone
(rank 0's directive), everything else is a sum (the loss over the last stage's
ranks, a count per directive outcome, the observers' per-stage sums). So the payload
is HEADER_SLOTS + the observers' slots floats whatever the world size, every backend
has the operation (gloo and NCCL), and decoding it costs the same on 8 ranks as on
16,384.

Header layout (floats):
    LOSS_SUM, LOSS_WEIGHT   loss of the ranks that report one (last stage, tp_rank 0), and their count
    ACTION, DIRECTIVE_ID, TO_STEP, SKIP, RUN_KEY
                            rank 0 only: the directive every rank acts on after this boundary
                            (TO_STEP -1: the newest verified checkpoint; RUN_KEY: run_key(run_id))
    REPORT_ID               rank 0 only: the id of the last directive it handled
    APPLIED .. IGNORED      each rank adds 1 under the outcome of the last directive it handled
    LOADED_SUM              each rank that loaded a checkpoint adds the step it loaded + 1
    NO_CHECKPOINT .. OTHER_RUN  each rank that failed or ignored one adds 1 under its reason
    RANKS                   each rank adds 1

Every rank receives every directive at the same boundary and handles it before the
next one, so all ranks' last handled directive is rank 0's: once the outcome counts add
up to RANKS, rank 0 knows every rank's outcome of REPORT_ID without any per-rank message.
This is also what makes pause, resume and rollback happen on every rank at the same step.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parwatch.contract.directives import Action, Directive, FailReason, Outcome
from parwatch.contract.spans import BoundaryKind, Event, HookRegistry, SpanKind
from parwatch.contract.spans import registry as default_registry
from parwatch.vocabulary import CollectiveOp, GroupRole

(
    LOSS_SUM,
    LOSS_WEIGHT,
    ACTION,
    DIRECTIVE_ID,
    TO_STEP,
    SKIP,
    RUN_KEY,
    REPORT_ID,
    APPLIED,
    FAILED,
    SUBSTITUTED,
    IGNORED,
    LOADED_SUM,
    NO_CHECKPOINT,
    CHECKPOINT_CORRUPT,
    LOAD_ERROR,
    OTHER_RUN,
    RANKS,
) = range(18)
HEADER_SLOTS = 18
_OUTCOME_SLOT = {
    Outcome.APPLIED: APPLIED,
    Outcome.FAILED: FAILED,
    Outcome.SUBSTITUTED: SUBSTITUTED,
    Outcome.IGNORED: IGNORED,
}
_REASON_SLOT = {
    FailReason.NO_CHECKPOINT: NO_CHECKPOINT,
    FailReason.CHECKPOINT_CORRUPT: CHECKPOINT_CORRUPT,
    FailReason.LOAD_ERROR: LOAD_ERROR,
    FailReason.OTHER_RUN: OTHER_RUN,
}


SETTLE_SECONDS = 2.0
"""How long rank 0 waits at the run's end for its sidecar's answer on the last steps (a post takes
milliseconds; a sidecar away costs the run this much once)."""

AllReduceSum = Callable[[list[float]], Sequence[float] | Callable[[], Sequence[float]]]
"""SUM-all-reduces a float64 vector over every rank: returns the sums, or starts the
all-reduce and returns a zero-argument callable that waits for it and returns them."""


def new_run_id() -> str:
    """A fresh run id: the launch time (UTC) and 6 random hex digits, e.g. 20261203-004100-5f3a9c.
    Made once per launch (on rank 0, then shared), so a relaunch never mixes with the last run's records."""
    return time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + os.urandom(3).hex()


def run_key(run_id: str) -> float:
    """A 48-bit hash of a run id: exact in a float64 slot, so equal ids compare equal."""
    return float(int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:6], "big"))


@dataclass(frozen=True)
class OutcomeReport:
    """What every rank did with the last directive rank 0 handled, from the summed counts."""

    directive_id: int
    counts: dict[Outcome, int]
    """Outcome -> ranks."""
    reasons: dict[FailReason, int]
    """FailReason -> ranks."""
    loaded_step: int | None
    """The checkpoint step the loading ranks loaded (they agree on it), or None."""
    ranks: int

    @property
    def complete(self) -> bool:
        """Every rank reported an outcome for directive_id."""
        return self.directive_id > 0 and sum(self.counts.values()) == self.ranks

    @property
    def outcome(self) -> Outcome | None:
        """The common outcome, or None when ranks differ (see counts)."""
        present = [o for o, n in self.counts.items() if n]
        return present[0] if len(present) == 1 else None


@dataclass(frozen=True)
class BoundaryInfo:
    """What every rank learns at a step boundary, after the boundary all-reduce."""

    step: int
    """The step just finished (0 at the start of training; repeats while paused)."""
    kind: BoundaryKind
    loss: float
    """The step's loss as the last stage computed it (mean over the reporting ranks); NaN if none."""
    directive: Directive | None
    """Rank 0's directive, which every rank acts on after this boundary (None if none)."""
    report: OutcomeReport
    start: object = None
    """Clock mark when this rank entered the boundary."""
    end: object = None
    """Clock mark when the boundary all-reduce returned."""
    world_size: int = 0


@dataclass
class _Handled:
    directive_id: int
    outcome: Outcome
    loaded_step: int | None
    reason: FailReason | None


class Unresumable(RuntimeError):
    """A run paused (its pre-step check's skips) with no sidecar to resume it: StepBoundary.hold stops it."""


class StepBoundary:
    """Runs the step boundary for one rank; the trainer supplies the all-reduce.

        boundary = StepBoundary(rank, world_size, run_id, all_reduce_sum, reports_loss=last_stage and tp_rank == 0)
        boundary.exchange(BoundaryKind.START, 0)
        for step in ...:
            loss = train_step()
            mean_loss, directive = boundary.exchange(BoundaryKind.STEP, step, loss)
            if directive: apply it, then boundary.report(directive, Outcome.APPLIED)

    `all_reduce_sum(values: list[float]) -> list[float]` must SUM-all-reduce the list over every
    rank of the run (float64; e.g. a torch tensor and dist.all_reduce). It is called once per
    exchange, and once per `agree`. It may instead start the all-reduce and return a
    zero-argument callable that waits for it and returns the sums (`dist.all_reduce(...,
    async_op=True)`): while it is in flight the observers do the part of their boundary work
    that needs no result (`Observer.during_boundary`), so that work costs the step no time.
    An all-reduce with a `close()` gets it from `StepBoundary.close()`, the trainer's first step
    of shutdown (TorchAllReduce's waits until torch has let go of its tensors).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        run_id: str,
        all_reduce_sum: AllReduceSum,
        *,
        reports_loss: bool,
        registry: HookRegistry = default_registry,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"StepBoundary: rank={rank} must be in 0..{world_size - 1}")
        if not run_id:
            raise ValueError("StepBoundary: run_id must be the run's id (the same non-empty string on every rank)")
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.registry = registry
        self.reports_loss = reports_loss
        self._all_reduce = all_reduce_sum
        self._key = run_key(run_id)
        self._last_id = 0
        self._handled: _Handled | None = None

    # ------------------------------------------------------------------------------- exchange
    def exchange(self, kind: BoundaryKind, step: int, loss: float | None = None) -> tuple[float, Directive | None]:
        """Join the boundary; returns (mean loss, a new directive of this run to apply, or None).

        A directive for another run is not returned: it is reported IGNORED (reason OTHER_RUN)."""
        reg = self.registry
        observed = reg.boundary_slots if reg.active else 0
        vec = [0.0] * (HEADER_SLOTS + observed)
        # Directives ride only on step and heartbeat boundaries, whose callers act on them.
        offer = (
            reg.pending_directive()
            if self.rank == 0 and kind in (BoundaryKind.STEP, BoundaryKind.HEARTBEAT) and reg.active
            else None
        )
        self._pack(vec, loss, offer)
        if observed:
            part = vec[HEADER_SLOTS:]
            reg.fill_boundary(step, part)
            vec[HEADER_SLOTS:] = part
        start = reg.mark()
        with reg.span(
            SpanKind.BOUNDARY,
            op=CollectiveOp.ALL_REDUCE,
            group=GroupRole.WORLD,
            bytes=len(vec) * 8,
            group_size=self.world_size,
        ):
            out = self._all_reduce(vec)
            if callable(out):  # in flight: the observers' work meanwhile is free
                if reg.active:
                    reg.during_boundary()
                out = out()
        end = reg.mark()
        weight = out[LOSS_WEIGHT]
        mean_loss = out[LOSS_SUM] / weight if weight else float("nan")
        directive = self._unpack_directive(out)
        if reg.active:
            info = BoundaryInfo(step, kind, mean_loss, directive, self._report(out), start, end, self.world_size)
            reg.emit_boundary(info, list(out[HEADER_SLOTS:]))
        if directive is None or directive.id <= self._last_id:
            return mean_loss, None
        self._last_id = directive.id
        if directive.run_id != self.run_id:
            self.report(directive, Outcome.IGNORED, reason=FailReason.OTHER_RUN, step=step)
            return mean_loss, None
        return mean_loss, directive

    def settle(self, step: int, timeout_s: float = SETTLE_SECONDS) -> Directive | None:
        """After the run's last step, on every rank: rank 0 has the last steps judged (its sidecar judges a
        step in the next step's view; at most `timeout_s`), then every rank joins one heartbeat boundary.
        Returns a directive decided on the last steps, to apply like any other (None: the run may end)."""
        if self.rank == 0 and self.registry.active:
            self.registry.settle(step, timeout_s)
        return self.exchange(BoundaryKind.HEARTBEAT, step)[1]

    def agree(self, ok: bool) -> bool:
        """True when every rank passes ok=True (one 1-float all-reduce; every rank must call it)."""
        out = self._all_reduce([1.0 if ok else 0.0])
        return int(round((out() if callable(out) else out)[0])) == self.world_size

    def close(self, timeout_s: float = 5.0) -> None:
        """After the last boundary, before the process group is destroyed: let the all-reduce
        release what it lent the collective library (its `close(timeout_s)`, when it has one)."""
        close = getattr(self._all_reduce, "close", None)
        if close is not None:
            close(timeout_s)

    def report(
        self,
        directive: Directive,
        outcome: Outcome,
        *,
        loaded_step: int | None = None,
        reason: FailReason | None = None,
        step: int | None = None,
    ) -> None:
        """This rank's outcome of `directive`; it rides every boundary until the next directive."""
        outcome = Outcome(outcome)
        if outcome not in _OUTCOME_SLOT:
            raise ValueError(f"a rank's outcome is one of {', '.join(_OUTCOME_SLOT)}, not {outcome}")
        self._handled = _Handled(directive.id, outcome, loaded_step, reason)
        self.registry.emit_event(
            Event.DIRECTIVE_APPLIED,
            id=directive.id,
            action=directive.action.value,
            step=step,
            outcome=outcome,
            loaded_step=loaded_step,
            reason=reason,
        )

    def hold(
        self,
        step: int,
        poll_s: float,
        sleep: Callable[[float], None] = time.sleep,
        report: Callable[[Directive, Outcome], None] | None = None,
    ) -> Directive | None:
        """Paused: join heartbeat boundaries until a resume (reported, then a resume boundary;
        returns None) or a rollback (returned unreported: the caller applies it).

        `report(directive, outcome)`: the caller's own reporting, which must end in self.report
        (a trainer that also notes what it applied); default: self.report.

        Raises Unresumable, on every rank, when rank 0 (which takes the run's directives) has nothing that
        could bring a resume (no observer reports to a sidecar: Observer.directs): such a run would
        otherwise wait forever."""
        if not self.agree(self.rank != 0 or (self.registry.active and self.registry.directed())):
            raise Unresumable(
                f"paused at step {step}, and nothing watching this run can resume it (no parwatch sidecar: "
                "a collector with an endpoint); stopping rather than waiting forever"
            )
        while True:
            sleep(poll_s)
            _, directive = self.exchange(BoundaryKind.HEARTBEAT, step)
            if directive is None:
                continue
            if directive.action == Action.ROLLBACK:
                return directive
            # A pause while paused changes nothing; a resume ends the hold.
            if report is not None:
                report(directive, Outcome.APPLIED)
            else:
                self.report(directive, Outcome.APPLIED, step=step)
            if directive.action == Action.RESUME:
                self.exchange(BoundaryKind.RESUME, step)
                return None

    # ------------------------------------------------------------------------------- encoding
    def _pack(self, vec: list[float], loss: float | None, offer: Directive | None) -> None:
        if self.reports_loss and loss is not None:
            vec[LOSS_SUM] = loss
            vec[LOSS_WEIGHT] = 1.0
        if offer is not None:
            vec[ACTION] = float(Action(offer.action).code)
            vec[DIRECTIVE_ID] = float(offer.id)
            vec[TO_STEP] = float(-1 if offer.to_step is None else offer.to_step)
            vec[SKIP] = float(offer.skip_batches)
            vec[RUN_KEY] = run_key(offer.run_id)
        handled = self._handled
        if handled is not None:
            if self.rank == 0:
                vec[REPORT_ID] = float(handled.directive_id)
            vec[_OUTCOME_SLOT[handled.outcome]] += 1.0
            if handled.loaded_step is not None:
                vec[LOADED_SUM] += float(handled.loaded_step + 1)  # +1: step 0 is a step too
            if handled.reason is not None:
                vec[_REASON_SLOT[handled.reason]] += 1.0
        vec[RANKS] = 1.0

    def _unpack_directive(self, out: Sequence[float]) -> Directive | None:
        action = Action.from_code(int(out[ACTION]))
        if action is None:
            return None
        to_step = int(out[TO_STEP])
        key = out[RUN_KEY]
        return Directive(
            id=int(out[DIRECTIVE_ID]),
            action=action,
            run_id=self.run_id if key == self._key else f"<run key {int(key):012x}>",
            to_step=None if to_step < 0 else to_step,
            skip_batches=int(out[SKIP]),
        )

    @staticmethod
    def _report(out: Sequence[float]) -> OutcomeReport:
        counts = {o: int(round(out[slot])) for o, slot in _OUTCOME_SLOT.items()}
        loaders = counts[Outcome.APPLIED] + counts[Outcome.SUBSTITUTED]
        loaded = out[LOADED_SUM]
        return OutcomeReport(
            directive_id=int(out[REPORT_ID]),
            counts=counts,
            reasons={r: int(round(out[slot])) for r, slot in _REASON_SLOT.items() if out[slot]},
            loaded_step=int(round(loaded / loaders)) - 1 if loaders and loaded else None,
            ranks=int(round(out[RANKS])),
        )
