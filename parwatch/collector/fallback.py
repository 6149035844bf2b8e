"""Rank 0's own guardrail while it cannot reach its sidecar, the run's leader (issue 24, item 6).

The leader judges the rules; when it is away, a NaN/inf loss would go unjudged and the run would
train on poisoned weights. Rank 0 knows every step's loss (the boundary all-reduce carries it)
and whether its summary reached the sidecar (shipper.Delivery), so it applies one rule itself,
conservatively: a non-finite loss whose summary the sidecar did not take pauses the run, through
the directive path every rank already follows (offered at the next boundary, applied by all ranks
at that one boundary). It never rolls back on its own: the leader's rules (its checkpoint list,
skip policy, rollback budget) decide that.

The decision rides the outcome record of its directive (`"local": {...}`), which rank 0 resends
until the sidecar accepts it. The leader records it as a decision (source rank0), counts its
directive as applied, and judges the reported loss as if the summary had arrived: its
nonfinite-loss rule then rolls back once. A loss the leader did see is never decided here, so one
event gets one rollback.

Directive ids only grow (a rank ignores an id at or below the last it handled): the local id is
one above every id rank 0 has seen, and the record names the last id the ranks handled before it
(`after`) so the leader renumbers any directive of its own that rank 0 never took.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from typing import Final

import msgspec

from parwatch.collector.shipper import Delivery
from parwatch.contract.directives import Action, Directive
from parwatch.vocabulary import jsonable
from parwatch.wire.steps import LocalDecision, OutcomeRecord

log = logging.getLogger("parwatch.collector")

LOCAL_RULE: Final = "nonfinite-loss"
"""The one rule rank 0 applies itself (the leader's rule of that name judges the loss again)."""
LOCAL_DECISIONS_FILE = "local_decisions.jsonl"
"""Written next to summaries.jsonl: the local decisions, for an operator without a sidecar."""


class LocalGuard:
    """Rank 0: watches the first unjudged non-finite loss; offers a pause when the sidecar never took it.

    Training thread only (the boundary hooks); the shipper thread writes the Delivery it reads."""

    def __init__(
        self,
        run_id: str,
        time_fn: Callable[[], float],
        unreachable_since: Callable[[], float | None],
        log_dir: str | None = None,
    ):
        self.run_id = run_id
        self._time = time_fn
        self._unreachable_since = unreachable_since
        self._path = os.path.join(log_dir, LOCAL_DECISIONS_FILE) if log_dir else None
        self._watch: tuple[int, float, Delivery] | None = None  # (step, loss, its summary's delivery)
        self._seen_id = 0  # the highest directive id rank 0 has seen, in a reply or at a boundary
        self._handled_id = 0  # the highest directive id offered to the ranks at a boundary
        self._local: LocalDecision | None = None  # the local decision whose outcome has not been reported yet
        self._local_id = 0
        self.decisions = 0
        """Local decisions made so far."""

    def saw(self, directive_id: int, handled: bool = False) -> None:
        """A directive id rank 0 met: in the sidecar's reply, or (handled) offered at a boundary."""
        self._seen_id = max(self._seen_id, directive_id)
        if handled:
            self._handled_id = max(self._handled_id, directive_id)

    def loss(self, step: int, loss: float, delivery: Delivery | None) -> None:
        """A step's loss and its summary's delivery: a non-finite one is watched (the first at a time)."""
        if delivery is not None and not math.isfinite(loss) and self._watch is None and self._local is None:
            self._watch = (step, loss, delivery)

    def never_judged(self, step: int) -> None:
        """The run's last step: the leader judges a step's loss in the next step's view, which will not
        come, so a watched loss of this step counts as a summary the sidecar did not take."""
        watch = self._watch
        if watch is not None and watch[0] == step:
            unsent = Delivery()
            unsent.accepted = False
            self._watch = (step, watch[1], unsent)

    def rolled_back(self) -> None:
        """The ranks went back: a watched loss belongs to the steps they discarded."""
        self._watch = None

    def offer(self, checkpoints: list[int]) -> Directive | None:
        """At a boundary: the local pause, once the watched summary is known not to have reached the sidecar."""
        watch = self._watch
        if watch is None or watch[2].accepted is None:
            return None
        self._watch = None
        if watch[2].accepted:  # the leader has it and judges it
            return None
        step, loss, _ = watch
        self._local_id = max(self._seen_id, self._handled_id) + 1
        since = self._unreachable_since()
        reason = (
            f"{LOCAL_RULE}: loss {jsonable(loss)} at step {step} and the sidecar did not take its "
            f"summary{'' if since is None else f' (unreachable since {since:.3f})'}: rank 0 pauses the run "
            "until the leader judges it"
        )
        usable = [c for c in checkpoints if c <= step][-1000:]  # later ones belong to a timeline rolled back
        self._local = LocalDecision(
            rule=LOCAL_RULE,
            action=Action.PAUSE.value,
            step=step,
            loss=jsonable(loss),
            time=self._time(),
            after=self._handled_id,
            checkpoints=usable,
            unreachable_since=since,
            reason=reason,
        )
        self.decisions += 1
        log.error("parwatch: %s (directive %d)", reason, self._local_id)
        self._write({"directive_id": self._local_id, "run_id": self.run_id, **msgspec.to_builtins(self._local)})
        return Directive(id=self._local_id, action=Action.PAUSE, run_id=self.run_id, reason=reason)

    def annotate(self, record: OutcomeRecord) -> OutcomeRecord:
        """The outcome record of the local directive carries its decision to the leader."""
        if self._local is not None and record.directive_id == self._local_id:
            record, self._local = msgspec.structs.replace(record, local=self._local), None
        return record

    def _write(self, record: dict) -> None:
        if self._path is None:
            return
        try:
            with open(self._path, "a") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")
        except (OSError, ValueError) as err:
            log.warning("parwatch: cannot write %s (%s)", self._path, err)
