"""Directives the leader hands to rank 0, oldest first, until the run reports their outcome.

A directive is the contract's Directive (parwatch.contract.directives), held here as Outstanding with
what the leader keeps of it. Its states: created (queued here: it can be cancelled) -> delivered (in a
reply to the run's ingest: the ranks will apply it, and cancelling it is refused) -> handled (its outcome
arrived: removed). Rank 0 hands it to every rank at a step boundary; every rank's outcome comes back
counted in the boundary vector, and rank 0 reports one outcome record for the whole run (no per-rank
acknowledgements). The directive is then done, whatever the outcome.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

from parwatch.contract.directives import MAX_STEP, Directive, parse_directive
from parwatch.vocabulary import Action, DirectiveState

log = logging.getLogger("parwatch.guardrails")
WIRE_KEYS = ("id", "action", "run_id", "to_step", "skip_batches", "reason")


@dataclass
class Outstanding:
    """A directive handed out (or waiting to be) and without an outcome yet."""

    directive: Directive
    decision_id: int | None = None
    """The decision that made it (None: unknown)."""
    delivered_at: float | None = None
    """When it went out to the run (this engine's clock); None: created, and cancellable."""

    def wire(self) -> dict[str, Any]:
        """The wire dict rank 0 gets in an ingest reply (WIRE_KEYS, in order)."""
        return asdict(self.directive)

    def state(self) -> dict[str, Any]:
        """As status and a refused cancel show it."""
        delivered = self.delivered_at is not None
        return {
            "id": self.directive.id,
            "action": self.directive.action,
            "state": DirectiveState.DELIVERED if delivered else DirectiveState.CREATED,
            "delivered_at": self.delivered_at,
        }

    def saved(self) -> dict[str, Any]:
        """As the store keeps it (a directives row; decisions.jsonl's recovery builds the same dict)."""
        return {**self.wire(), "decision_id": self.decision_id, "delivered_at": self.delivered_at}

    @classmethod
    def from_saved(cls, saved: dict) -> Outstanding:
        """Back from saved(); ValueError (naming the field) for one a trainer could not parse."""
        directive = parse_directive({k: saved.get(k) for k in WIRE_KEYS})
        return cls(directive, saved.get("decision_id"), saved.get("delivered_at"))


class Directives:
    def __init__(self, first_id: int = 1):
        self.outstanding: list[Outstanding] = []
        """Handed out (or waiting to be) and without an outcome yet, oldest first."""
        self.next_id = first_id
        """Ids only grow: a trainer ignores an id at or below the last it handled. A sidecar that lost
        its state dir starts from the clock (milliseconds), so its first directive is still newer than
        anything the running trainer saw; float64-exact in the boundary slot."""

    def add(
        self,
        action: str,
        run_id: str,
        to_step: int | None,
        skip_batches: int,
        reason: str,
        decision_id: int | None = None,
    ) -> int:
        """Queue a directive; ValueError (naming the field) when the trainer could not parse it: the one
        parser (parwatch.contract.parse_directive) builds it here, so none that passes can block a run."""
        directive = parse_directive(
            {
                "id": self.next_id,
                "action": action,
                "run_id": run_id,
                "to_step": to_step,
                "skip_batches": skip_batches if action == Action.ROLLBACK else 0,
                "reason": reason,
            }
        )
        self.outstanding.append(Outstanding(directive, decision_id))
        self.next_id += 1
        return directive.id

    def adopt(
        self, directive_id: int, action: str, run_id: str, reason: str, decision_id: int | None, delivered_at: float
    ) -> None:
        """A directive rank 0 made itself and already handed to every rank (parwatch/collector/fallback.py):
        outstanding until its outcome is recorded; later ids start above it."""
        directive = Directive(directive_id, Action(action), run_id, reason=reason)
        self.outstanding.append(Outstanding(directive, decision_id, delivered_at))
        self.next_id = max(self.next_id, directive_id + 1)

    def renumber(self, after: int, upto: int) -> dict[int, int]:
        """Outstanding directives with after < id <= upto, which rank 0 never took and now would ignore
        (its last id is `upto`): new ids above it, again undelivered. {old id: new id}."""
        self.next_id = max(self.next_id, upto + 1)
        changed = {}
        for d in self.outstanding:
            if after < d.directive.id <= upto:
                changed[d.directive.id] = self.next_id
                d.directive, d.delivered_at = replace(d.directive, id=self.next_id), None
                self.next_id += 1
        return changed

    def oldest(self, run_id: str | None) -> Outstanding | None:
        """The oldest outstanding directive of `run_id` (its delivered_at set once it went out), or None."""
        return next((d for d in self.outstanding if d.directive.run_id == run_id), None)

    def find(self, directive_id: int) -> Outstanding | None:
        return next((d for d in self.outstanding if d.directive.id == directive_id), None)

    def remove(self, directive_id: int) -> Outstanding | None:
        """Take the directive out (its outcome arrived, or it was cancelled); None if not outstanding."""
        d = self.find(directive_id)
        if d is not None:
            self.outstanding.remove(d)
        return d

    def restore(self, items: list[dict], next_id: int | None) -> None:
        """Saved outstanding directives (Outstanding.saved), and the next id (at least; None: none saved, the
        clock's stays). What a trainer could never parse (an id or step past 2**53, a wrong type: a log edited
        by hand) is dropped with a warning, never handed out to block the directives after it."""
        self.outstanding = []
        for d in items:
            try:
                self.outstanding.append(Outstanding.from_saved(d))
            except ValueError as err:
                log.warning("saved directive dropped: %s", err)
        if next_id is not None and not (type(next_id) is int and 0 < next_id < MAX_STEP):
            log.warning("directive id %s is not usable (1..2**53-1); ignored", next_id)
            next_id = None
        after = 1 + max((d.directive.id for d in self.outstanding), default=0)
        self.next_id = max(self.next_id if next_id is None else next_id, after)
