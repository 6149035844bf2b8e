"""The guardrail engine: the decisions of policy.py under one lock, made durable in the store (engine_store.py).

The sidecar feeds one Observation per training step (evaluate), calls check_no_data every second and
hands rank 0 the directives (pending_directive) until the run reports their outcome (record_outcome);
operators and Alertmanager go through request(). The state lives in STATE_DIR/parwatch.db, so a
restarted sidecar continues where it stopped; decisions.jsonl is written from it. A new run id starts
a clean engine (begin_run): the previous run's rows stay, marked archived, and its log moves to
STATE_DIR/runs/RUN_ID/.

Durability: each call that changes the state commits it, with its records, in one transaction
before it returns (a decision, an outcome, a delivery: synchronous=FULL; counters: NORMAL); the
baseline windows go with it at most once a minute (BASELINES_SAVE_SECONDS). In full:
docs/architecture.md, "The engine's durability". Deferred (defer_writes(), the sidecar's mode):
"before it returns" becomes "before take_writes()'s batch is written", which the sidecar does in a
writer thread before it answers the request; a burst of evaluations then costs one transaction.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from parwatch.guardrails.engine_store import Batch, StateStore, StorageFault
from parwatch.guardrails.policy import RECENT_RECORDS, DirectiveDelivered, Observation, Policy
from parwatch.guardrails.rules import RuleSet

__all__ = ["BASELINES_SAVE_SECONDS", "DirectiveDelivered", "GuardrailEngine", "Observation"]

log = logging.getLogger(__name__)

BASELINES_SAVE_SECONDS = 60.0
"""How stale the saved baseline windows may get: they are most of the state's bytes (see Durability)."""

P = ParamSpec("P")
R = TypeVar("R")


def _through(decide: Callable[Concatenate[Policy, P], R]) -> Callable[Concatenate[GuardrailEngine, P], R]:
    """The policy's `decide`, under the engine's lock; what it changed is then saved (see Durability)."""

    @functools.wraps(decide)
    def call(engine: GuardrailEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with engine._lock:
            try:
                return decide(engine.policy, *args, **kwargs)
            finally:
                engine._owe()

    return call


class GuardrailEngine:
    def __init__(self, rules: RuleSet, state_dir: str | Path, now: Callable[[], float] = time.time):
        self._lock = threading.RLock()
        self._now = now
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        self._store = StateStore(state)
        self._deferred = False
        self._started = now()
        """When this engine started: silence before it is the sidecar's own downtime, not the run's."""
        self._start(rules)

    def _start(self, rules: RuleSet, write: bool = True) -> None:
        """A policy with the committed state (the store's, else the log's). write=False (recover): what the
        start would write (repairs, the state read from the log) waits for the next write instead."""
        self._batch = Batch(self._store)
        """Writes owed since the last take_writes(): records as they are made, the state when dirty."""
        self._dirty = False
        self._baselines_saved = -math.inf
        """When the baseline windows were last saved (this clock); -inf: owed with the next save."""
        self._queued_batches: list[Batch] = []
        """Deferred mode: writes of an archived run, with the move of its log, for take_writes()."""
        self.policy = Policy(rules, self._now, self._started)
        saved, recovered = self._store.load(RECENT_RECORDS, self._now(), repair=write)
        self.policy.restore(saved)
        if recovered and saved.get("records"):  # the database starts from what the log says
            for record in saved["records"]:
                self._batch.record(self.policy.run_id, record, logged=True)
            if write:
                self._save(full=True)
            else:
                self._dirty = True

    # -- the policy's decisions, saved ----------------------------------------------------------------

    evaluate = _through(Policy.evaluate)
    check_no_data = _through(Policy.check_no_data)
    record_finding = _through(Policy.record_finding)
    observe_now = _through(Policy.observe_now)
    record_check = _through(Policy.record_check)
    transient_faults = _through(Policy.transient_faults)
    request = _through(Policy.request)
    pending_directive = _through(Policy.pending_directive)
    directive_states = _through(Policy.directive_states)
    record_outcome = _through(Policy.record_outcome)
    cancel = _through(Policy.cancel)
    ended = _through(Policy.ended)
    states = _through(Policy.states)
    decisions = _through(Policy.decisions)

    @property
    def run_id(self) -> str | None:
        with self._lock:
            return self.policy.run_id

    @property
    def paused(self) -> bool:
        with self._lock:
            return self.policy.run.paused

    @property
    def last_switch(self) -> float | None:
        """When a rollback or resume was last decided or applied (this clock): the hang clock restarts there."""
        return self.policy.last_switch

    @property
    def rollbacks_delivered(self) -> int:
        """Rollback directives of the current run handed out: how far its timeline may have moved (Policy)."""
        return self.policy.rollbacks_delivered

    def begin_run(self, run_id: str) -> bool:
        """The run whose rank 0 reports here is `run_id`; a new one starts a clean engine.

        The previous run's rows stay in the store, marked archived (its outstanding directives with
        them: never handed to the new run), and its decisions.jsonl moves to STATE_DIR/runs/RUN_ID/.
        Returns True when the run changed. A run already archived is not taken back (a late post of an
        old run)."""
        with self._lock:
            if not self.policy.is_new_run(run_id):
                return False
            ended = self.policy.run_id
            if ended is None:
                self._batch.claim_records(run_id)
            else:  # the old run's last state and records, its archiving, then the move of its log, in that order
                self._baselines_saved, self._dirty = -math.inf, True
                batch = self.take_writes()
                self._store.archive(batch, ended, self._now())
                if self._deferred:
                    self._queued_batches.append(batch)
                else:
                    batch.write()
            self.policy.begin_run(run_id)
            self._save(full=True)
            return True

    def reload(self, rules: RuleSet) -> None:
        """Swap in new rules; a rule whose name survives keeps its state (and baseline, if still valid)."""
        with self._lock:
            self.policy.reload(rules)
            self._baselines_saved = -math.inf
            self._save(full=True)

    def acted_alerts(self) -> list[str]:
        """Fingerprints of the Alertmanager alerts acted on (sidecar/alerts.py), oldest first."""
        return self._store.acted_alerts()

    def note_alert(self, fingerprint: str, acted: bool) -> None:
        """An alert acted on (or resolved): saved with the decision it made, in one transaction (deferred)."""
        with self._lock:
            self._batch.alert(fingerprint, acted)
            self._save()

    # -- durability -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Save everything, the baseline windows included, and checkpoint the WAL before shutdown; the
        engine stays usable. A state dir that cannot be written loses only what was never answered."""
        with self._lock:
            self._baselines_saved = -math.inf
            self._dirty = True
            batch = self.take_writes()
        try:
            batch.write()
        except StorageFault as err:
            log.error("the last state could not be saved at shutdown: %s", err)
        self._store.checkpoint()

    @property
    def epoch(self) -> int:
        """Bumped each time a failed write made the engine put back its committed state (recover): a request
        that began in an earlier epoch may have had what it decided undone."""
        return self._store.epoch

    def recover(self) -> bool:
        """After a failed write (StorageFault): put back the state last committed, so that nothing decided
        since (a decision, a directive, a delivery, a rule's firing) stands without its record. False when
        there was nothing to put back (another caller did already)."""
        with self._lock:
            if self._store.failed is None:
                return False
            self._store.put_back()
            last_switch = self.policy.last_switch
            self._start(self.policy.rules, write=False)
            self.policy.last_switch = last_switch
            log.warning("state put back to the last committed write: nothing decided since it stands")
            return True

    def defer_writes(self) -> None:
        """From now on, collect writes for take_writes() instead of committing them (see Durability, deferred)."""
        with self._lock:
            self._deferred = True

    def take_writes(self) -> Batch:
        """The writes owed so far (deferred mode), as one batch to write in order; empty when none."""
        with self._lock:
            batch, self._batch = self._batch, Batch(self._store)
            run_id = self.policy.run_id
            if self._dirty and run_id is not None:  # nothing of a run to keep before one begins
                batch.run(run_id, *self.policy.snapshot())
                now = self._now()
                if not 0 <= now - self._baselines_saved < BASELINES_SAVE_SECONDS:  # a clock gone back: due
                    batch.per_rule("baselines", run_id, self.policy.baselines())
                    self._baselines_saved = now
            self._dirty = False
            batch.earlier, self._queued_batches = self._queued_batches, []
            return batch

    def _owe(self) -> None:
        """Take what the policy made since the last call into the batch: its records, and its state if it
        changed (saved now, or owed to take_writes() when deferred)."""
        policy = self.policy
        for record in policy.unsaved:
            self._batch.record(policy.run_id, record)
        policy.unsaved = []
        if policy.changed:
            policy.changed = False
            self._save()

    def _save(self, full: bool = False) -> None:
        """The state changed: commit it now, or with take_writes()'s batch (deferred). full: a change that
        must survive a power loss too (records make a batch full by themselves). Not deferred, a failed
        write puts back the committed state and raises StorageFault."""
        self._dirty = True
        self._batch.full |= full
        if not self._deferred:
            try:
                self.take_writes().write()
            except StorageFault:
                self.recover()
                raise
