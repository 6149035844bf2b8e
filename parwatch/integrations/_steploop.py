"""The step loop every framework integration shares: the run's first boundary, the check before
each optimizer step, one boundary per optimizer step, and the directives (pause, resume, rollback)
that come back through it.

An integration builds one `StepLoop` with its rank's pipeline position, a contract `StepBoundary`,
a `StepCheck` over the same all-reduce and the user's checkpoint loader, and calls `begin` /
`check_step` / `step_done` / `end` at the framework's own step edges. What a bad step or a directive
does is decided here, once, for every framework: a bad step is re-run, skipped, or skipped and the
run paused (parwatch.contract.step_check); pause holds the run in heartbeat boundaries until resume;
rollback calls `load_checkpoint(step) -> loaded_step` (or `load_checkpoint(step, skip_batches)`) on
every rank and continues from the step it returns, `data_offset` batches further on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from parwatch.contract import (
    Action,
    BoundaryKind,
    Event,
    FailReason,
    Outcome,
    SpanKind,
    StepBoundary,
    StepCheck,
    StepPolicy,
    Verdict,
    registry,
    torch_grads,
)

log = logging.getLogger("parwatch.integrations")


class IntegrationError(RuntimeError):
    """The run cannot be watched as given; the message says what to change."""


class StepLoop:
    """Boundaries and directives for one rank.

    pp_rank: this rank's pipeline stage (span and event attrs).
    boundary: the contract's step-boundary driver (one small SUM all-reduce per step).
    load_checkpoint: `f(step or None) -> loaded step`, called on every rank for a rollback
        directive (None asks for the newest checkpoint). It must load the same step on every
        rank or raise on every rank; without it rollbacks are reported failed (no_checkpoint).
        A loader that takes a second argument gets the directive's skip_batches (to skip them in
        a data iterator it owns); either way `data_offset` counts them.
    pause_poll_s: seconds between heartbeat boundaries while paused.
    step_check: the check before each optimizer step (None: off)."""

    def __init__(
        self,
        *,
        pp_rank: int,
        boundary: StepBoundary,
        load_checkpoint: Callable[..., int] | None = None,
        pause_poll_s: float = 0.2,
        step_check: StepCheck | None = None,
    ) -> None:
        self.pp_rank = pp_rank
        self.boundary = boundary
        self.load_checkpoint = load_checkpoint
        self._loader_skips = load_checkpoint is not None and _takes_two(load_checkpoint)
        self.pause_poll_s = pause_poll_s
        self.step_check = step_check
        self.verdict: Verdict | None = None
        """The check's verdict on the step being finished (None: not checked, or off)."""
        self.step_checks: list[dict] = []
        """The verdicts of the steps the check found bad (re-run, skipped, paused)."""
        self.data_offset = 0
        """Batches rollbacks skipped so far on this timeline: step s trains batch s + data_offset (for data
        indexed by step; a loader that takes skip_batches may skip them itself instead)."""
        self._offsets: dict[int, int] = {}  # checkpoint step -> data_offset when it was saved
        self.step = 0
        """The last optimizer step finished (the boundary's step number)."""
        self.timeline = 0
        """Rollbacks applied so far in this run."""
        self.applied: list[dict] = []
        """Directives this rank handled: {id, action, step, outcome, ...} (a resume ending a pause: no id)."""

    def begin(
        self,
        step: int,
        config: dict,
        pipeline_order: dict,
        model_flops_per_step: float | None = None,
        data_offset: int = 0,
    ) -> int:
        """run_start (with the schedule's action order for the bubble theory), then the run's
        first boundary on every rank; `step`: where training resumes (0: fresh); `data_offset`: the
        batches earlier rollbacks skipped (saved with the checkpoint resumed from)."""
        self.step, self.data_offset = step, data_offset
        order = {rank: [str(a) for a in acts] for rank, acts in pipeline_order.items()}
        registry.emit_event(
            Event.RUN_START,
            rank=self.pp_rank,
            config=config,
            model_flops_per_step=model_flops_per_step,
            pipeline_order=order,
        )
        self.boundary.exchange(BoundaryKind.START, self.step)
        return self.step

    def optimizer_step(self, optimizer, *args, **kwargs):
        """`optimizer.step()` inside an optimizer span (other time, not bubble)."""
        with registry.span(SpanKind.OPTIMIZER, stage=self.pp_rank):
            return optimizer.step(*args, **kwargs)

    def check_step(
        self, params: Sequence, loss_of: Callable[[], float | None], rerun: Callable[[], None] | None
    ) -> Verdict | None:
        """The check before this step's optimizer step, on every rank (None when it is off): `params` hold
        the step's gradients, `loss_of()` reads this rank's loss, `rerun()` runs the step's forward and
        backward again on the same microbatches from zeroed gradients (None: a bad step is skipped)."""
        if self.step_check is None:
            return None
        step = self.step + 1
        reports_loss = self.boundary.reports_loss

        def measure():
            return torch_grads.reading(loss_of() if reports_loss else None, torch_grads.grads_of(params))

        self.verdict = verdict = self.step_check.run(step, measure, rerun, batch=step + self.data_offset)
        self._note(verdict)
        return verdict

    def _note(self, verdict: Verdict) -> None:
        if verdict.action is not None:
            self.step_checks.append(verdict.as_dict())

    def data(self):
        """`with watch.data(): batch = next(loader)`: blocking on data, timed (the ledger's data wait)."""
        return registry.span(SpanKind.DATA, stage=self.pp_rank)

    def checkpoint(self):
        """`with watch.checkpoint(): save(...)`: the blocking part of a checkpoint save, timed."""
        return registry.span(SpanKind.CHECKPOINT, stage=self.pp_rank)

    def evaluation(self):
        """`with watch.evaluation(): evaluate(...)`: an eval between training steps (not bubble, not a step)."""
        return registry.span(SpanKind.EVAL, stage=self.pp_rank)

    def boundary_step(self, loss: float | None, last: bool = False) -> int:
        """The boundary after an optimizer step, on every rank, then any directive it brought; after the
        `last` step, the settling boundary too (settle). Returns the step training continues from: the one
        just finished, or the loaded one."""
        self.step += 1
        trained = self.step
        _, directive = self.boundary.exchange(BoundaryKind.STEP, self.step, loss)
        verdict, self.verdict = self.verdict, None
        handled = len(self.applied)
        if directive is not None:
            self._apply(directive)
        if verdict is not None and verdict.pause and self.step == trained:
            # Every rank decided it at the check: skips keep coming. Held like a pause directive, unless
            # one just held the run (the operator has seen it and resumed).
            if not any(a["action"] == Action.PAUSE for a in self.applied[handled:]):
                log.error("rank %d: step %d: %s; pausing", self.pp_rank, self.step, verdict.evidence.get("pause"))
                self._hold()
        if last and self.step == trained:
            self.settle()
        return self.step

    def settle(self) -> int:
        """After the run's last step, on every rank: the last steps judged (StepBoundary.settle) and what
        that brings applied. Returns the step training continues from: the last (the run may end), or the
        checkpoint a rollback loaded (train on to the last step again)."""
        directive = self.boundary.settle(self.step)
        if directive is not None:
            self._apply(directive)
        return self.step

    def checkpoint_saved(self, step: int, checkpoints: list[int] | None = None) -> None:
        """Tell the collector a complete checkpoint of `step` exists (a rollback target);
        `checkpoints`: every complete step on disk now, if known."""
        attrs: dict[str, Any] = {"step": step}
        if checkpoints is not None:
            attrs["checkpoints"] = list(checkpoints)
        self._offsets[step] = self.data_offset
        registry.emit_event(Event.CHECKPOINT_SAVED, **attrs)

    def end(self, summary: dict | None = None) -> None:
        """run_end (observers may add their run totals to `summary`), then release the boundary's
        all-reduce (see TorchAllReduce.close): before destroy_process_group."""
        registry.emit_event(Event.RUN_END, steps_completed=self.step, summary={} if summary is None else summary)
        self.boundary.close()

    # ------------------------------------------------------------------ directives
    def detach(self) -> None:
        """Remove the framework's instrumentation (each integration's own)."""
        raise NotImplementedError

    def close(self, summary: dict | None = None) -> None:
        """run_end (observers may add their run totals to `summary`), then detach, and release the
        boundary's all-reduce (see TorchAllReduce.close): call it before destroy_process_group."""
        self.end(summary)
        self.detach()

    def _apply(self, directive) -> None:
        if directive.action == Action.PAUSE:
            self._report(directive, Outcome.APPLIED)
            self._hold()
        elif directive.action == Action.ROLLBACK:
            self._rollback(directive)
        else:  # resume while running: seen, nothing to do
            self._report(directive, Outcome.APPLIED)

    def _hold(self) -> None:
        """Paused: heartbeat boundaries until a resume (or a rollback, applied)."""
        registry.emit_event(Event.PAUSED, step=self.step)
        log.warning("rank %d: paused at step %d", self.pp_rank, self.step)
        rollback = self.boundary.hold(self.step, self.pause_poll_s)  # reports the resume itself
        if rollback is not None:
            self._rollback(rollback)
        else:
            self.applied.append({"action": Action.RESUME.value, "step": self.step, "outcome": Outcome.APPLIED})

    def _report(self, directive, outcome, **extra) -> None:
        self.applied.append(
            {
                "id": directive.id,
                "action": str(getattr(directive.action, "value", directive.action)),
                "step": self.step,
                "outcome": outcome.name.lower(),
                **{k: getattr(v, "name", v) for k, v in extra.items()},
            }
        )
        self.boundary.report(directive, outcome, step=self.step, **extra)

    def _rollback(self, directive) -> None:
        from_step, asked = self.step, directive.to_step
        loaded, reason = None, FailReason.NO_CHECKPOINT
        if self.load_checkpoint is not None:
            try:
                loaded = (
                    self.load_checkpoint(asked, directive.skip_batches)
                    if self._loader_skips
                    else self.load_checkpoint(asked)
                )
            except FileNotFoundError as exc:
                log.error("rank %d: rollback to %s: %s", self.pp_rank, asked, exc)
            except Exception as exc:  # the user's loader failed: report it, keep training as we are
                log.error("rank %d: load_checkpoint(%s) failed: %s", self.pp_rank, asked, exc)
                reason = FailReason.LOAD_ERROR
            if loaded is not None and (not isinstance(loaded, int) or loaded < 0):
                log.error("rank %d: load_checkpoint returned %r, not a step", self.pp_rank, loaded)
                loaded, reason = None, FailReason.LOAD_ERROR
        # agree() is a collective every rank joins; when it holds, this rank loaded a step too.
        if not self.boundary.agree(loaded is not None) or loaded is None:
            self._report(directive, Outcome.FAILED, reason=reason)
            return
        self.step = loaded
        self.timeline += 1
        # The batches the directive skips: after what was skipped before the checkpoint loaded (the offset it
        # was saved with; unknown, as after a restart: today's).
        self.data_offset = self._offsets.get(loaded, self.data_offset) + directive.skip_batches
        self._offsets = {s: o for s, o in self._offsets.items() if s <= loaded}
        outcome = Outcome.APPLIED if asked is None or loaded == asked else Outcome.SUBSTITUTED
        self._report(directive, outcome, loaded_step=loaded)
        registry.emit_event(Event.ROLLBACK, from_step=from_step, to_step=loaded, skip_batches=directive.skip_batches)
        self.boundary.exchange(BoundaryKind.RESUME, self.step)


def step_check_for(boundary: StepBoundary, all_reduce, check: bool | StepPolicy) -> StepCheck | None:
    """The integrations' `check=` argument: True (the default policy), a StepPolicy, or False (off)."""
    if check is False:
        return None
    policy = check if isinstance(check, StepPolicy) else None
    return StepCheck(boundary.rank, boundary.world_size, all_reduce, policy=policy, registry=boundary.registry)


def _takes_two(loader: Callable[..., int]) -> bool:
    """Whether `loader` accepts a second positional argument (skip_batches)."""
    try:
        params = list(inspect.signature(loader).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2
