"""Directives the leader hands to rank 0, oldest first, until the run reports their outcome.

A directive is the schema's Directive: {id, action, run_id, to_step, skip_batches, reason}.
Rank 0 hands it to every rank at a step boundary; every rank's outcome comes back counted in
the boundary vector, and rank 0 reports one outcome record for the whole run (no per-rank
acknowledgements). The directive is then done, whatever the outcome.
"""

from __future__ import annotations

WIRE_KEYS = ("id", "action", "run_id", "to_step", "skip_batches", "reason")


class Directives:
    def __init__(self, first_id: int = 1):
        self.outstanding: list[dict] = []
        """Handed out (or waiting to be) and without an outcome yet, oldest first."""
        self.next_id = first_id
        """Ids only grow: a trainer ignores an id at or below the last it handled. A sidecar that lost
        its state dir starts from the clock (milliseconds), so its first directive is still newer than
        anything the running trainer saw; float64-exact in the boundary slot."""

    def add(self, action: str, run_id: str, to_step: int | None, skip_batches: int, reason: str,
            decision_id: int | None = None) -> int:
        directive = {"id": self.next_id, "action": action, "run_id": run_id, "to_step": to_step,
                     "skip_batches": skip_batches if action == "rollback" else 0, "reason": reason,
                     "decision_id": decision_id}
        self.outstanding.append(directive)
        self.next_id += 1
        return directive["id"]

    def oldest(self, run_id: str | None) -> dict | None:
        """The oldest outstanding directive of `run_id` as the wire dict, or None."""
        d = next((d for d in self.outstanding if d["run_id"] == run_id), None)
        return None if d is None else {k: d[k] for k in WIRE_KEYS}

    def find(self, directive_id: int) -> dict | None:
        return next((d for d in self.outstanding if d["id"] == directive_id), None)

    def remove(self, directive_id: int) -> dict | None:
        """Take the directive out (its outcome arrived, or it was cancelled); None if not outstanding."""
        d = self.find(directive_id)
        if d is not None:
            self.outstanding.remove(d)
        return d

    def drop_other_runs(self, run_id: str) -> list[dict]:
        """Directives of any other run: they can never be applied by this one."""
        dropped = [d for d in self.outstanding if d["run_id"] != run_id]
        self.outstanding = [d for d in self.outstanding if d["run_id"] == run_id]
        return dropped

    def to_dict(self) -> dict:
        return {"next_id": self.next_id, "outstanding": self.outstanding}

    def restore(self, saved: dict, min_next_id: int = 1) -> None:
        self.outstanding = [dict(d) for d in saved.get("outstanding", []) if "run_id" in d]
        self.next_id = max(int(saved.get("next_id", self.next_id)), min_next_id,
                           1 + max((d["id"] for d in self.outstanding), default=0))
