"""Directives (what the leader sidecar asks of a run) and outcomes (what every rank did about one).

One definition for every process: the trainer, the collector, the sidecar and the
guardrail engine all import these enums (Action, Outcome and FailReason are defined in
parwatch.vocabulary); the boundary vector carries their counts, the wire their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

# The contract's names, defined with the vocabulary.
from parwatch.vocabulary import Action as Action
from parwatch.vocabulary import FailReason as FailReason
from parwatch.vocabulary import Outcome as Outcome

ACTIONS = tuple(a.value for a in Action)
"""The wire names, in order: what APIs and rule files accept."""


@dataclass(frozen=True)
class Directive:
    id: int
    """Unique, increasing id the leader sidecar gives it; every rank reports its outcome under it."""
    action: Action
    run_id: str
    """The run it belongs to: a trainer of another run ignores it (Outcome.IGNORED)."""
    to_step: int | None = None
    """Rollback: the checkpoint step to load; None means the newest verified one."""
    skip_batches: int = 0
    """Rollback: data batches to skip after loading (0 replays the same batches)."""
    reason: str = ""


MAX_STEP = 2**53
"""Step numbers, checkpoint steps and skip counts travel as float64: exact up to here."""


def parse_directive(raw: object) -> Directive:
    """A directive from its wire dict; ValueError names the bad field and what it must be."""
    if not isinstance(raw, dict):
        raise ValueError(f"directive must be an object, got {type(raw).__name__}")
    did, action, run_id = raw.get("id"), raw.get("action"), raw.get("run_id")
    to_step, skip = raw.get("to_step"), raw.get("skip_batches", 0)
    if not _is_int(did) or not 0 < did < MAX_STEP:
        raise ValueError(f"directive id={did!r} must be an integer in 1..2**53-1")
    if action not in ACTIONS:
        raise ValueError(f"directive action={action!r} must be one of {', '.join(ACTIONS)}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"directive run_id={run_id!r} must be the run's id (a non-empty string)")
    if to_step is not None and (not _is_int(to_step) or not 0 <= to_step < MAX_STEP):
        raise ValueError(f"directive to_step={to_step!r} must be null or an integer in 0..2**53-1")
    if not _is_int(skip) or not 0 <= skip < MAX_STEP:
        raise ValueError(f"directive skip_batches={skip!r} must be an integer in 0..2**53-1")
    return Directive(
        id=did,
        action=Action(action),
        run_id=run_id,
        to_step=to_step,
        skip_batches=skip,
        reason=str(raw.get("reason", "")),
    )


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)
