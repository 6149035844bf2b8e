"""Alertmanager webhook -> guardrail requests, at most once per firing alert.

Alertmanager re-sends a firing alert every repeat_interval and after its own restarts;
the fingerprint set (saved in the engine's store with the decisions the alerts made, so a
sidecar restart does not act twice either) makes each firing alert act once. A resolved
notification clears it, so the same alert firing again later acts again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from parwatch.vocabulary import RuleAction
from parwatch.wire.bodies import Alert, AlertmanagerPayload

log = logging.getLogger(__name__)

ALERT_ACTIONS = (RuleAction.PAUSE, RuleAction.ROLLBACK)
ACTION_LABEL = "parwatch_action"
MAX_ACTED = 10_000
"""Firing alerts remembered as acted on; the oldest are forgotten beyond this (bounded memory and table)."""


def fingerprint(alert: Alert) -> str:
    if alert.fingerprint:
        return alert.fingerprint
    # Alertmanager always sends one; hash the labels for senders that do not.
    return hashlib.sha256(json.dumps(alert.labels, sort_keys=True).encode()).hexdigest()[:16]


class AlertDedupe:
    def __init__(self, acted: list[str], save: Callable[[str, bool], None]):
        """acted: the fingerprints saved, oldest first; save(fingerprint, acted): keep the change."""
        self.acted = dict.fromkeys(acted)  # insertion-ordered: the oldest go first when over MAX_ACTED
        self.save = save

    def reload(self, acted: list[str]) -> None:
        """The fingerprints as saved (after a failed write put back the engine's state: an alert whose
        decision was undone acts again when Alertmanager resends it)."""
        self.acted = dict.fromkeys(acted)

    def handle(self, payload: AlertmanagerPayload, request) -> list[dict]:
        """Call request(action, reason=, rule=, requested_by=[, skip_batches=]) once for each new firing
        alert that asks for pause or rollback; return the decisions made."""
        decisions = []
        for alert in payload.alerts:
            fp = fingerprint(alert)
            if alert.status == "resolved":
                if fp in self.acted:
                    del self.acted[fp]
                    self.save(fp, False)
                continue
            action = alert.labels.get(ACTION_LABEL)
            if action not in ALERT_ACTIONS or fp in self.acted:
                continue
            name = alert.labels.get("alertname", "alert")
            summary = alert.annotations.get("summary") or payload.commonAnnotations.get("summary", "")
            reason = f"{name}: {summary}" if summary else name
            kw: dict[str, Any] = {
                "reason": reason,
                "rule": alert.labels.get("rule"),
                "requested_by": f"alertmanager:{payload.receiver}" if payload.receiver else "alertmanager",
            }
            if action == RuleAction.ROLLBACK:
                skip = alert.labels.get("parwatch_skip_batches", "0")
                kw["skip_batches"] = int(skip) if skip.isascii() and skip.isdigit() and len(skip) <= 9 else 0
            try:
                decision = request(action, **kw)
            except ValueError as err:
                if action != RuleAction.ROLLBACK:
                    log.warning("alert %s (%s) refused by the engine: %s", name, fp, err)
                    continue
                # No checkpoint to go back to: stopping is the safe half of what the alert asked for.
                kw.update(reason=f"{reason} (rollback impossible: {err}; pausing instead)", skip_batches=0)
                decision = request("pause", **kw)
            self.acted[fp] = None
            self.save(fp, True)
            while len(self.acted) > MAX_ACTED:
                oldest = next(iter(self.acted))
                del self.acted[oldest]
                self.save(oldest, False)
            decisions.append(decision)
        return decisions
