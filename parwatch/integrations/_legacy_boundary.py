"""TRANSITIONAL stand-in for parwatch.contract until it is merged (see `_contract`): the
contract's enums and a StepBoundary with its methods (exchange, report, agree, hold) that
speaks today's protocol (trainer.boundary's rows, trainer.hooks' registry), so the collector
on this branch sees exactly what the bundled trainer sends. Delete at the merge.
"""

from __future__ import annotations

import time
from enum import Enum, IntEnum

from trainer import boundary as _bnd
from trainer.hooks import BoundaryInfo as _BoundaryInfo
from trainer.hooks import registry  # noqa: F401


class SpanKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    LOSS = "loss"
    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"
    OPTIMIZER = "optimizer"
    DP_SYNC = "dp_sync"
    CHECKPOINT = "checkpoint"
    DATA = "data"
    BOUNDARY = "boundary"


class Event(str, Enum):
    RUN_START = "run_start"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    DIRECTIVE_APPLIED = "directive_applied"
    PAUSED = "paused"
    ROLLBACK = "rollback"
    RUN_END = "run_end"


class BoundaryKind(str, Enum):
    START = "start"
    STEP = "step"
    HEARTBEAT = "heartbeat"
    RESUME = "resume"


class Action(str, Enum):
    PAUSE = "pause"
    RESUME = "resume"
    ROLLBACK = "rollback"


class Outcome(IntEnum):
    APPLIED = 1
    FAILED = 2
    SUBSTITUTED = 3
    IGNORED = 4


class FailReason(IntEnum):
    NO_CHECKPOINT = 1
    CHECKPOINT_CORRUPT = 2
    LOAD_ERROR = 3
    OTHER_RUN = 4


class StepBoundary:
    def __init__(self, rank, world_size, run_id, all_reduce_sum, *, reports_loss, registry=registry):
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.registry, self.reports_loss, self._all_reduce = registry, reports_loss, all_reduce_sum
        self._last_id = 0

    def exchange(self, kind, step, loss=None):
        reg = self.registry
        observed = reg.boundary_slots
        width = _bnd.TRAINER_SLOTS + observed
        start = reg.mark()
        row = [0.0] * width
        offer = reg.pending_directive() if self.rank == 0 and kind in (BoundaryKind.STEP, BoundaryKind.HEARTBEAT) \
            else None
        _bnd.pack_row(row, loss if self.reports_loss else None, offer)
        if observed:
            part = row[_bnd.TRAINER_SLOTS:]
            reg.fill_boundary(step, part)
            row[_bnd.TRAINER_SLOTS:] = part
        vec = [0.0] * (self.world_size * width)
        vec[self.rank * width:(self.rank + 1) * width] = row
        attrs = {"op": "all_reduce", "group": "world", "bytes": len(vec) * 8, "group_size": self.world_size}
        with reg.span("collective", **attrs):
            out = self._all_reduce(vec)
        rows = [list(out[r * width:(r + 1) * width]) for r in range(self.world_size)]
        end = reg.mark()
        mean_loss, directive = _bnd.unpack([r[:_bnd.TRAINER_SLOTS] for r in rows])
        if reg.active:
            info = _BoundaryInfo(step, kind.value, [r[:_bnd.TRAINER_SLOTS] for r in rows], mean_loss, directive,
                                 start, end)
            reg.emit_boundary(info, [r[_bnd.TRAINER_SLOTS:] for r in rows])
        if directive is None or directive.id <= self._last_id:
            return mean_loss, None
        self._last_id = directive.id
        return mean_loss, directive

    def agree(self, ok: bool) -> bool:
        return int(round(self._all_reduce([1.0 if ok else 0.0])[0])) == self.world_size

    def report(self, directive, outcome, *, loaded_step=None, reason=None, step=None):
        self.registry.emit_event("directive_applied", id=directive.id, action=str(directive.action), step=step,
                                 outcome=Outcome(outcome).name.lower(), loaded_step=loaded_step)

    def hold(self, step, poll_s, sleep=time.sleep):
        while True:
            sleep(poll_s)
            _, directive = self.exchange(BoundaryKind.HEARTBEAT, step)
            if directive is None:
                continue
            if directive.action == "rollback":
                return directive
            self.report(directive, Outcome.APPLIED, step=step)
            if directive.action == "resume":
                self.exchange(BoundaryKind.RESUME, step)
                return None
