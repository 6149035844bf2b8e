"""The step boundary: one small collective on the world group, every step.

Every rank contributes one row of floats; the rows are disjoint slices of one
float64 vector, so a SUM all-reduce is a gather that every backend has (gloo
has no all_gather of unequal ranks' rows into one tensor in one call cheaper
than this, and NCCL treats it as one small all-reduce).

Row layout (TRAINER_SLOTS floats, then each observer's slots):
    0 loss          the step's loss on last-stage ranks with tp_rank 0, else 0
    1 loss_weight   1 on those ranks, else 0 (mean over DP replicas)
    2 action        rank 0 only: directive action code (0 none)
    3 directive_id  rank 0 only
    4 to_step       rank 0 only: rollback target checkpoint step (-1: newest)
    5 skip_batches  rank 0 only

This is the one place where pause, resume and rollback are decided for all
ranks: since every rank reads the same vector, they all act at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TRAINER_SLOTS = 6
ACTIONS = {0: None, 1: "pause", 2: "resume", 3: "rollback"}
ACTION_CODES = {v: k for k, v in ACTIONS.items() if v}


@dataclass(frozen=True)
class Directive:
    id: int
    """Unique, increasing id the sidecar gives it; ranks report it back when applied."""
    action: str
    """"pause", "resume" or "rollback"."""
    to_step: int | None = None
    """Rollback: the checkpoint step to load; None means the newest complete one."""
    skip_batches: int = 0
    """Rollback: data batches to skip after loading (0 replays the same batches)."""
    reason: str = ""


def pack_row(row: list, loss: float | None, directive: Directive | None) -> None:
    if loss is not None:
        row[0] = loss
        row[1] = 1.0
    if directive is not None:
        row[2] = float(ACTION_CODES[directive.action])
        row[3] = float(directive.id)
        row[4] = float(-1 if directive.to_step is None else directive.to_step)
        row[5] = float(directive.skip_batches)


def unpack(rows: list) -> tuple[float, Directive | None]:
    """From all ranks' trainer slots: (mean loss over reporting ranks, rank 0's directive)."""
    weight = sum(r[1] for r in rows)
    loss = sum(r[0] for r in rows if r[1]) / weight if weight else math.nan
    head = rows[0]
    action = ACTIONS.get(int(head[2]))
    directive = None
    if action:
        to_step = int(head[4])
        directive = Directive(
            id=int(head[3]), action=action, to_step=None if to_step < 0 else to_step, skip_batches=int(head[5])
        )
    return loss, directive
