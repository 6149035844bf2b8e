"""The sidecar's behaviour, free of HTTP: ingest, control, alerts, status, rules reload.

app.py maps requests onto these methods. They run on one event loop (or one test
thread), so writes never race; a /metrics scrape interleaved with them reads only
immutable values (store.py).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.rules import RulesError, default_rules, load_rules
from parwatch.schema import encode_float
from parwatch.sidecar.alerts import AlertDedupe
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.exporter import SidecarCounters, make_registry
from parwatch.sidecar.models import AlertmanagerPayload, ControlRequest, IngestBody
from parwatch.sidecar.observations import build_observation
from parwatch.sidecar.store import Store
from parwatch.sidecar.transfer import TransferTracker

log = logging.getLogger(__name__)


class Sidecar:
    def __init__(self, config: SidecarConfig, engine, clock: Callable[[], float] = time.time):
        self.config = config
        self.engine = engine
        self.clock = clock
        self.store = Store(config.rank_grace_seconds, clock=clock)
        self.counters = SidecarCounters()
        self.transfer = TransferTracker()
        self.registry = make_registry(self.store, engine, self.counters, self.transfer)
        state_dir = Path(config.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.alerts = AlertDedupe(state_dir / "alerts_acted.json")

    # -- writes -----------------------------------------------------------------------------
    def ingest(self, body: IngestBody) -> dict:
        if body.alive and self.engine.paused:
            # A paused run sends no summaries; rank 0 polls instead, and says "alive" only when a
            # heartbeat collective (which every rank must join) completed since its last post.
            # Without this a long operator pause would read as dead ranks.
            self.store.touch_all()
        for outcome in body.outcomes:
            if outcome.run_id == self.engine.run_id:
                self._count(self.engine.record_outcome(outcome.model_dump()))
            else:
                log.warning("outcome of directive %d for run %s, not the current run: ignored", outcome.directive_id,
                            _printable(outcome.run_id))
        for s in body.summaries:
            if s.rank == 0 and s.run_id != self.engine.run_id:
                try:
                    self.engine.begin_run(s.run_id)  # a new run: a clean engine (the old one archived)
                except ValueError as err:
                    log.warning("summary refused: %s", err)
                    continue
            if not self.store.add(s):
                continue  # a retried post: already counted and evaluated
            self.transfer.add(s)
            # Rank 0 sends one summary per step, so a new one carrying the fast-path view is a new
            # global step (retries stopped above; the engine also ignores a repeated step).
            if s.global_ is not None and self.store.global_view is s.global_:
                obs = build_observation(self.store)
                if obs is not None:
                    obs.series.update(self.transfer.take_series())
                    self._count(self.engine.evaluate(obs))
        return {"accepted": len(body.summaries), "directive": self.engine.pending_directive()}

    def cancel(self, directive_id: int, requested_by: str = "operator") -> dict:
        """Withdraw an outstanding directive; ValueError when there is none with that id."""
        return self.engine.cancel(directive_id, requested_by)

    def control(self, req: ControlRequest, requested_by: str = "operator") -> dict:
        """An operator's pause/resume/rollback; ValueError when the engine refuses it."""
        decision = self.engine.request(
            req.action,
            source="operator",
            reason=req.reason,
            to_step=req.to_step,
            skip_batches=req.skip_batches,
            requested_by=req.requested_by or requested_by,
        )
        self._count([decision])
        return decision

    def alert_webhook(self, payload: AlertmanagerPayload) -> list[dict]:
        def request(action, **kw):
            return self.engine.request(action, source="alertmanager", **kw)

        decisions = self.alerts.handle(payload, request)
        self._count(decisions)
        return decisions

    def tick(self) -> list[dict]:
        """Ask the engine about rules whose metric went silent; the server calls this every second."""
        decisions = self.engine.check_no_data()
        self._count(decisions)
        return decisions

    def reload_rules(self) -> bool:
        """Re-read the rules file (SIGHUP). An invalid file keeps the old rules and counts a failure."""
        path = self.config.rules_path
        try:
            rules = load_rules(path) if path is not None else default_rules()
        except (RulesError, OSError) as err:
            self.counters.rules_reload_failures += 1
            for line in str(err).splitlines():
                log.error("rules reload refused, keeping the old rules: %s", line)
            return False
        self.engine.reload(rules)
        log.info("rules reloaded from %s", path or "the packaged defaults")
        return True

    def _count(self, decisions) -> None:
        for d in decisions or ():
            if d and d.get("type", "decision") == "decision" and d.get("action"):  # not outcome records
                self.counters.actions[(str(d.get("rule") or d.get("source") or "operator"), str(d["action"]))] += 1

    # -- reads ------------------------------------------------------------------------------
    def status(self, decisions: int = 10) -> dict:
        head = self.store.run_summary()
        run = None
        if head is not None:
            run = {k: getattr(head, k) for k in ("run_id", "schedule", "tp", "pp", "dp", "microbatches", "chunks")}
        ranks = {
            str(rank): {
                "last_step": rec.summary.step,
                "age_seconds": round(self.store.age(rec), 3),
                "up": self.store.is_up(rec),
            }
            for rank, rec in sorted(self.store.ranks.items())
        }
        return jsonable(
            {
                "run": run,
                "last_step": self.store.last_step,
                "ranks": ranks,
                "rules": self.engine.states(),
                "paused": self.engine.paused,
                "pending_directive": self.engine.pending_directive(),
                "last_decisions": self.engine.decisions(decisions),
            }
        )

    def decisions(self, limit: int) -> list:
        return jsonable(self.engine.decisions(limit))


def _printable(text: str) -> str:
    """Control characters escaped: a client's string must not forge log lines."""
    return text.encode("unicode_escape").decode("ascii")


def jsonable(obj):
    """JSON has no NaN/inf: encode them as the schema does ("nan", "inf", "-inf")."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else encode_float(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def build_sidecar(config: SidecarConfig, clock: Callable[[], float] = time.time) -> Sidecar:
    """Load the rules (RulesError names every problem) and start the engine on the state dir."""
    rules = load_rules(config.rules_path) if config.rules_path is not None else default_rules()
    Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    engine = GuardrailEngine(rules, Path(config.state_dir), now=clock)
    return Sidecar(config, engine, clock=clock)
