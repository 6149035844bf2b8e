"""Directives the trainer fetches, oldest first, until every rank has applied them.

A directive is the schema's Directive: {id, action, to_step, skip_batches, reason}. The
trainer's rank 0 hands it to all ranks at a step boundary and each rank reports it back
as applied; the directive is done once all world_size ranks have.
"""

from __future__ import annotations


class Directives:
    def __init__(self, first_id: int = 1):
        self.outstanding: list[dict] = []
        """Not yet applied by every rank, oldest first; each also holds acks {rank: step}."""
        self.next_id = first_id
        """Ids only grow: the trainer ignores an id at or below the last it applied. A sidecar
        that lost its state dir starts from the clock (milliseconds), so its first directive
        is still newer than anything the running trainer saw; float64-exact in the boundary slot."""

    def add(self, action: str, to_step: int | None, skip_batches: int, reason: str) -> int:
        directive = {"id": self.next_id, "action": action, "to_step": to_step,
                     "skip_batches": skip_batches if action == "rollback" else 0, "reason": reason, "acks": {}}
        self.outstanding.append(directive)
        self.next_id += 1
        return directive["id"]

    def oldest(self) -> dict | None:
        """The oldest outstanding directive as the wire dict, or None."""
        if not self.outstanding:
            return None
        d = self.outstanding[0]
        return {k: d[k] for k in ("id", "action", "to_step", "skip_batches", "reason")}

    def acknowledge(self, directive_id: int, rank: int, step: int, world_size: int) -> dict | None:
        """Note one rank's ack; returns the directive (with its acks) when every rank has applied it.

        Unknown or already completed ids are ignored: ranks may report the same ack twice.
        """
        directive = next((d for d in self.outstanding if d["id"] == directive_id), None)
        if directive is None or not 0 <= rank < world_size:
            return None
        directive["acks"][str(rank)] = int(step)
        if len(directive["acks"]) < world_size:
            return None
        self.outstanding.remove(directive)
        return directive

    def to_dict(self) -> dict:
        return {"next_id": self.next_id, "outstanding": self.outstanding}

    def restore(self, saved: dict, min_next_id: int = 1) -> None:
        self.outstanding = [dict(d, acks=dict(d.get("acks", {}))) for d in saved.get("outstanding", [])]
        self.next_id = max(int(saved.get("next_id", self.next_id)), min_next_id,
                           1 + max((d["id"] for d in self.outstanding), default=0))
