"""The guardrail engine's decisions, pure: rules over observations, acting, rollback planning, escalation,
the directives' lifecycle and the step-check records.

A Policy holds one run's state in memory and changes it: each call takes an input (an observation, an
operator's request, an outcome, a check record ...) and returns the decision records it made. It reads no
file, database or clock of its own (its clock is injected, `now`): what it made is owed to the store
(`unsaved`, `changed`), which GuardrailEngine (engine.py) commits, and a saved state comes back through
restore(). So a test drives it with a fake clock and no state dir, and the engine adds the lock and the
durability around it.

Steps: cooldown_steps and rollback_window_steps count executed steps (evaluations), not step numbers,
because step numbers repeat after a rollback and a loop must still count.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from parwatch.contract.directives import ACTIONS as DIRECTIVE_ACTIONS
from parwatch.contract.directives import MAX_STEP
from parwatch.guardrails.checks import NO_DATA, RuleMonitor, Series
from parwatch.guardrails.directives import Directives, Outstanding
from parwatch.guardrails.engine_store import evidence_dir
from parwatch.guardrails.rules import RuleSet
from parwatch.ledger_view import same_process
from parwatch.vocabulary import (
    Action,
    DecisionSource,
    Outcome,
    RecordType,
    RuleAction,
    RuleState,
    StepAction,
    Triage,
    jsonable,
)
from parwatch.wire.bounds import MAX_CHECKPOINTS, decode_float
from parwatch.wire.findings import Finding, NoDataEvidence, RequestEvidence, RollbackFailedEvidence
from parwatch.wire.log import HANDLED, Cancelled, Decision, Delivered, Handled, LogEntry, log_record

log = logging.getLogger(__name__)

SWITCHES = (Action.ROLLBACK, Action.RESUME)
"""Directives after which the run's next boundary may be long in coming (a checkpoint load, a restart of
the step loop): the hang clock is re-armed when one is decided and when it is applied."""

REQUEST_SOURCES = (DecisionSource.OPERATOR, DecisionSource.ALERTMANAGER)
TRANSIENT_METRIC = "transient_faults"
"""The series the engine adds to each observation: transient faults per rank (and host) so far in the run
(the checks before the optimizer step the re-run passed), judged by the suspect-device rule."""
RECENT_RECORDS = 1000
"""Records held in memory for decisions(limit); the store and decisions.jsonl hold them all."""


@dataclass(frozen=True)
class Observation:
    step: int
    time: float
    series: dict[str, dict[str, float]]
    """metric -> {series key -> value}, e.g. {"bubble_excess_ratio": {"stage=0": 0.01, "stage=1": 0.2}}."""
    checkpoints: tuple[int, ...] = ()
    """Steps with a complete checkpoint, as the trainer reported."""
    process_start_time: float | None = None
    """When rank 0's process started (its summary's): a later one is a restart of the trainer."""


class DirectiveDelivered(ValueError):
    """A cancel that came too late: the directive is already on its way to every rank."""

    def __init__(self, message: str, directive: dict):
        super().__init__(message)
        self.directive = directive


@dataclass
class RunState:
    """What the policy knows of the current run besides its rules, directives and records; a new run starts
    with a fresh one."""

    paused: bool = False
    tick: int = 0
    """Steps evaluated (executed, so counted again after a rollback)."""
    last_step: int | None = None
    first_seen_time: float | None = None
    resumed_time: float | None = None
    checkpoints: set[int] = field(default_factory=set)
    rollback_ticks: list[int] = field(default_factory=list)
    rearmed: dict[str, int] = field(default_factory=dict)
    """rule -> id of the operator resume that re-armed it (firing -> pending, see request())."""
    transients: dict[str, int] = field(default_factory=dict)
    """"rank=R[,host=H]" -> transient faults that rank produced in this run (from its step_check records)."""
    process_start: float | None = None


class Policy:
    """The decisions of one engine, over one run at a time (see the module docstring). Not thread-safe: the
    engine calls it under its lock."""

    def __init__(self, rules: RuleSet, now: Callable[[], float], started: float):
        self.rules = rules
        self._now = now
        self._started = started
        """When the engine started: silence before it is the sidecar's own downtime, not the run's."""
        self._metrics = {r.metric for r in rules.rules}
        self.monitors = {r.name: RuleMonitor(r) for r in rules.rules}
        self.directives = Directives(first_id=max(1, int(now() * 1000)))
        self.recent: deque[dict] = deque(maxlen=RECENT_RECORDS)
        self.run = RunState()
        self.run_id: str | None = None
        self.archived_runs: set[str] = set()
        self.next_decision_id = 1
        self.last_switch: float | None = None
        """When a rollback or resume was last decided or applied (this clock): the hang clock restarts there."""
        self.rollbacks_delivered = 0
        """Rollback directives of the current run handed out by this engine: how far the run's timeline may
        have moved since this engine first saw it (the store refuses a timeline no rollback explains)."""
        self.unsaved: list[dict] = []
        """Records made (and deliveries logged) since the engine last took them for the store, in order."""
        self.changed = False
        """The state changed since the engine last saved it (records make its commit survive a power loss)."""

    # -- observations ---------------------------------------------------------------------------------

    def evaluate(self, obs: Observation) -> list[dict]:
        """Judge every rule on one step's observation; returns the decision records made.

        Call once per step. A second observation of the step just evaluated (a retry, or a
        second rank's ingest) only refreshes last-seen times and checkpoints.
        """
        now = self._now()
        if self.run.first_seen_time is None:
            self.run.first_seen_time = now
        if obs.checkpoints:
            # The trainer lists the checkpoints complete on disk now; pruned ones (keep_checkpoints)
            # are gone, and a rollback to one would fail on every rank.
            self.run.checkpoints = set(map(int, obs.checkpoints))
        # Each metric's values are checked and reduced once, however many rules read them.
        usable = {metric: Series(_numbers(obs.series.get(metric))) for metric in self._metrics}
        if TRANSIENT_METRIC in usable and self.run.transients:
            usable[TRANSIENT_METRIC] = Series({k: float(n) for k, n in self.run.transients.items()})
        started = obs.process_start_time
        if started is not None:
            last = self.run.process_start
            if last is not None and started > last and not same_process(started, last):
                # Rank 0 is a new process of the same run: the trainer restarted (and resumed a checkpoint).
                # A pause does not outlive the processes it held: the new ones train.
                self._switched(f"a restart of the trainer at step {obs.step}")
                self.run.paused, self.run.resumed_time = False, now
            self.run.process_start = max(started, self.run.process_start or 0.0)
        if obs.step == self.run.last_step:
            for monitor in self.monitors.values():
                if usable[monitor.rule.metric]:
                    monitor.last_seen_time = now
            self.changed = True
            return []
        self.run.last_step = obs.step
        self.run.tick += 1
        records = []
        for monitor in self.monitors.values():
            values = usable[monitor.rule.metric]
            if values:
                if monitor.observe(obs.step, now, values):
                    records += self._act(monitor, obs.step, now)
                elif monitor.state == RuleState.OK:
                    self.run.rearmed.pop(monitor.rule.name, None)
                elif again := self._acts_again(monitor):
                    records += self._act(monitor, obs.step, now, again=again)
            else:
                records += self._judge_time(monitor, now)
        self.changed = True
        return records

    def check_no_data(self, paused: bool = False) -> list[dict]:
        """Time-driven judging between observations: for_seconds elapsing and metrics gone quiet.

        Silence is not a finding before the first observation (no run yet) or while paused (`paused`: the
        run says so, e.g. rank 0's heartbeats, before this engine has recorded the pause).
        """
        now = self._now()
        states = self._rule_states()
        records = []
        for monitor in self.monitors.values():
            records += self._judge_time(monitor, now, paused)
        if records or self._rule_states() != states:  # the sidecar calls this every second
            self.changed = True
        return records

    def _append(self, typed: LogEntry) -> dict:
        """A record made: among the recent ones, and owed to the store; returns it JSON-safe, as written."""
        record = log_record(typed)
        self.unsaved.append(record)
        self.recent.append(record)
        return record

    def _rule_states(self) -> list[str]:
        return [m.state for m in self.monitors.values()]

    def _judge_time(self, monitor: RuleMonitor, now: float, paused: bool = False) -> list[dict]:
        if monitor.tick(now):
            return self._act(monitor, self.run.last_step, now)
        # A paused run reports nothing on purpose: silence is a finding only while it runs.
        reference = max(
            (t for t in (monitor.last_seen_time or self.run.first_seen_time, self.run.resumed_time) if t is not None),
            default=None,
        )
        if reference is not None:  # the sidecar's own downtime is no silence of the run's
            reference = max(reference, self._started)
        if not (self.run.paused or paused) and monitor.no_data(now, reference):
            rule = monitor.rule
            seen = monitor.last_seen_time
            reason = f"no data for metric {rule.metric} for {rule.no_data_seconds:g} s " + (
                "(never reported)" if seen is None else f"(last reported at {seen:.0f})"
            )
            found = Decision(
                time=now,
                step=self.run.last_step,
                rule=rule.name,
                action=RuleAction.ALERT,
                source=DecisionSource.RULE,
                reason=reason,
                evidence=NoDataEvidence(metric=rule.metric, last_seen_time=seen, no_data_seconds=rule.no_data_seconds),
                finding=NO_DATA,
            )
            return [self._decide(found)]
        return []

    # -- acting ---------------------------------------------------------------------------------------

    def _acts_again(self, monitor: RuleMonitor) -> str:
        """Why a rule that fired, acted and still fails must act again ("" when it must not): the run changed
        under it (a rollback or resume applied, a restart, a skipped step), and what it did did not cure it.
        A rule that steers the run never stays firing and silent; an alert rule has said what it had to say.
        (While its own directive is outstanding nothing changed: acting again would queue behind it.)"""
        rule = monitor.rule
        if rule.action == RuleAction.ALERT or monitor.acted_tick is None or monitor.reason == NO_DATA:
            return ""
        return f"still failing after {monitor.switched}" if monitor.switched else ""

    def _switched(self, what: str, decided: int | None = None) -> None:
        """The run changed (`what`): every rule that acted and is still firing acts again if it fails again.
        Not one that acted after the switch was decided (`decided`: its decision id): its action was taken
        with the switch on its way (queued behind it), so the switch changed nothing under it."""
        for monitor in self.monitors.values():
            if monitor.state != RuleState.FIRING or monitor.acted_tick is None:
                continue
            if decided is not None and monitor.acted_decision is not None and monitor.acted_decision > decided:
                continue
            monitor.switched = what

    def _act(self, monitor: RuleMonitor, step: int | None, now: float, again: str = "") -> list[dict]:
        rule = monitor.rule
        evidence = monitor.evidence(step)
        action, reason, escalated = rule.action, f"{rule.name}: {monitor.reason}", False
        checkpoint, skip = None, 0
        rearmed_by = self.run.rearmed.get(rule.name)
        monitor.switched = None
        if again:
            # What it did did not cure it: stop, for an operator, instead of acting the same way again.
            action, escalated = RuleAction.PAUSE, True
            reason += f"; {again}: pausing the run"
        elif monitor.acted_tick is not None and self.run.tick - monitor.acted_tick < rule.cooldown_steps:
            if rule.action != RuleAction.ROLLBACK:
                monitor.reason += f" (cooldown: acted at step {monitor.acted_step}, no new action)"
                if rearmed_by is not None:
                    monitor.state = RuleState.PENDING  # still armed: act once the cooldown is over
                return []
            # Failing again so soon means the rollback did not cure it: stop instead of looping.
            action, escalated = RuleAction.PAUSE, True
            reason += (
                f"; failed again within cooldown_steps={rule.cooldown_steps} of its rollback at step "
                f"{monitor.acted_step}: pausing instead of rolling back again"
            )
        elif rule.action == RuleAction.ROLLBACK:
            first = monitor.since_step if monitor.since_step is not None else step
            action, checkpoint, skip, note = self._plan_rollback(first, step, rule.skip_batches)
            escalated = action != RuleAction.ROLLBACK
            reason += note
        monitor.acted_tick, monitor.acted_step = self.run.tick, step
        monitor.acted_decision = self.next_decision_id  # the id _decide gives it
        decision = Decision(
            time=now,
            step=step,
            rule=rule.name,
            action=action,
            source=DecisionSource.RULE,
            reason=reason,
            evidence=evidence,
            checkpoint=checkpoint,
            skip_batches=skip,
            escalated=escalated,
        )
        if rearmed_by is not None:
            del self.run.rearmed[rule.name]
            decision.reason += f" (re-armed by the operator's resume or cancel, decision {rearmed_by}: still failing)"
            decision.rearmed, decision.rearmed_by = True, rearmed_by
        return [self._decide(decision)]

    def _plan_rollback(
        self, first_failing: int | None, step: int | None, skip_setting
    ) -> tuple[RuleAction, int | None, int, str]:
        """(action, checkpoint, skip_batches, note): a rollback, or a pause when one would not help.
        step is None when no step was evaluated since a rollback was applied (or the run began)."""
        if first_failing is None:  # neither the failing run's start nor a step is known (a garbled state)
            return RuleAction.PAUSE, None, 0, "; escalated to pause: the failing step is unknown"
        checkpoint = max((c for c in self.run.checkpoints if c < first_failing), default=None)
        if checkpoint is None:
            return RuleAction.PAUSE, None, 0, f"; escalated to pause: no checkpoint before step {first_failing}"
        if skip_setting == "window" and step is None:
            return (
                RuleAction.PAUSE,
                None,
                0,
                (
                    "; escalated to pause: no step evaluated since the last rollback, so the "
                    "failing window's batches cannot be counted"
                ),
            )
        too_many = self._too_many_rollbacks()
        if too_many:
            return RuleAction.PAUSE, None, 0, too_many
        self.run.rollback_ticks.append(self.run.tick)
        skip = step - checkpoint if skip_setting == "window" and step is not None else int(skip_setting)
        return RuleAction.ROLLBACK, checkpoint, skip, f"; rollback to checkpoint {checkpoint}, skipping {skip} batches"

    def _too_many_rollbacks(self) -> str:
        """A note when another automatic rollback would exceed max_rollbacks in the window, else ""."""
        window, limit = self.rules.rollback_window_steps, self.rules.max_rollbacks
        self.run.rollback_ticks = [t for t in self.run.rollback_ticks if self.run.tick - t < window]
        if len(self.run.rollback_ticks) < limit:
            return ""
        return (
            f"; escalated to pause: {len(self.run.rollback_ticks)} rollbacks within the last {window} steps "
            f"(max_rollbacks={limit})"
        )

    def _decide(self, d: Decision, suppress: bool = False) -> dict:
        """Number and log decision `d` for the current run; when enforcing, a directive action also
        becomes a directive (which belongs to the current run: see begin_run). `suppress`: log only."""
        if d.action == Action.PAUSE and not suppress and self._pause_in_force():
            # Paused, and staying so once what is outstanding is applied: a second pause changes nothing.
            # (Paused with a resume outstanding is not: the pause queues behind the resume and holds
            # the run again, so a rule still failing after an operator resume is never silenced.)
            suppress = True
            d.reason += " (not enforced: the run is already paused or a pause is pending)"
        d.id, d.run_id = self.next_decision_id, self.run_id
        d.enforced = bool(self.rules.enforce) and not suppress and self.run_id is not None
        if d.enforced and self.run_id is not None and d.action in DIRECTIVE_ACTIONS:  # enforced implies a run
            d.directive_id = self.directives.add(
                d.action, self.run_id, d.checkpoint, d.skip_batches, d.reason, decision_id=d.id
            )
            if d.action in SWITCHES:
                self.last_switch = d.time
        self.next_decision_id += 1
        return self._append(d)

    def _pause_in_force(self) -> bool:
        """Whether the run is paused once the outstanding directives (oldest first) are applied."""
        paused = self.run.paused
        for d in (o.directive for o in self.directives.outstanding):
            if d.run_id == self.run_id:
                paused = d.action == Action.PAUSE or (paused and d.action not in SWITCHES)
        return paused

    # -- findings from outside the step rules (the hang detector) -------------------------------------

    def record_finding(
        self, rule: str, action: str, reason: str, evidence: Finding, step: int | None, bundle: str | None = None
    ) -> dict:
        """Record a decision made outside the rules (e.g. rule "hang" from parwatch.sidecar.hang).

        Only "alert" and "requeue" are accepted: such findings never steer the run through directives
        (a requeue is carried out by the sidecar itself, parwatch/sidecar/requeue.py). `bundle`: the run (as
        its ranks name it) whose evidence will be kept beside it; `evidence.bundle` names its directory
        (evidence_dir), relative to the state dir, in the logged line."""
        if action not in (RuleAction.ALERT, RuleAction.REQUEUE):
            raise ValueError(f"record_finding: action must be 'alert' or 'requeue', got {action!r}")
        if bundle is not None:
            evidence = replace(evidence, bundle=evidence_dir(bundle, self.next_decision_id))
        record = self._decide(
            Decision(
                time=self._now(),
                step=step,
                rule=rule,
                action=RuleAction(action),
                source=DecisionSource.RULE,
                reason=reason,
                evidence=evidence,
            )
        )
        self.changed = True
        return record

    def observe_now(self, metric: str, values: dict[str, float]) -> list[dict]:
        """Judge the rules on `metric` with values read now, between steps (liveness: rank_up).

        When every rank stops, no step observation arrives to judge rank_up; the sidecar calls
        this every second so a for_seconds rule on it still fires on time. Not while paused."""
        if self.run.paused or self.run.first_seen_time is None:
            return []
        now, records = self._now(), []
        series = Series(_numbers(values))
        for monitor in self.monitors.values():
            if monitor.rule.metric == metric and series:
                if monitor.observe(self.run.last_step if self.run.last_step is not None else -1, now, series):
                    records += self._act(monitor, self.run.last_step, now)
        self.changed = True
        return records

    # -- the check before the optimizer step (parwatch.contract.step_check) ---------------------------

    def record_check(self, check: dict, hosts: dict[int, str] | None = None) -> list[dict]:
        """A step every rank of the run checked before its optimizer step and found bad, and what they did
        together (re-run, skip, pause): recorded as a decision (source step_check, enforced: the ranks did
        it) with its triage, ranks and evidence. A transient counts towards its ranks' suspect-device
        series; a skip or a pause is a change of the run under the rules (a rule that acted and still fails
        acts again); a pause holds the run until a resume. `check`: a StepCheckRecord as a dict; `hosts`:
        rank -> host, where the sidecar knows it. A record sent twice is recorded once."""
        if self.run_id is None or check.get("run_id") != self.run_id:
            return []
        step, timeline = int(check["step"]), int(check.get("timeline") or 0)
        if any(
            r.get("source") == DecisionSource.STEP_CHECK and r.get("step") == step and r.get("timeline") == timeline
            for r in self.recent
        ):
            return []
        action, triage = StepAction(check["action"]), Triage(check["triage"])
        ranks = [int(r) for r in check.get("ranks") or ()]
        named = {r: hosts[r] for r in ranks if hosts and r in hosts}
        evidence = dict(check.get("evidence") or {}, loss=check.get("loss"))
        if named:
            evidence["hosts"] = {str(r): h for r, h in named.items()}
        who = ", ".join(f"rank {r}" + (f" on {named[r]}" if r in named else "") for r in ranks) or "no rank named"
        done = {
            StepAction.RERUN: "re-ran it on the same microbatches: it passed, its update went in",
            StepAction.SKIP: "skipped it: no update, the batch passed over",
            StepAction.PAUSE: f"skipped it and paused the run: {evidence.get('pause') or 'skips kept coming'}",
        }[action]
        batch = check.get("batch")
        reason = (
            f"{check['fault']}: step {step}"
            + (f" (batch {batch})" if batch is not None else "")
            + f" was {triage} ({who}); every rank {done}"
        )
        decision = Decision(
            time=self._now(),
            step=step,
            rule=str(check["fault"]),
            action=action,
            source=DecisionSource.STEP_CHECK,
            reason=reason,
            evidence=jsonable(evidence),
            escalated=action == StepAction.PAUSE,
            triage=triage,
            ranks=ranks,
            batch=batch,
            timeline=timeline,
        )
        decision.id, decision.run_id, decision.enforced = self.next_decision_id, self.run_id, True
        self.next_decision_id += 1
        if action != StepAction.RERUN:
            self._switched(f"the skip of step {step} before the weights")
        if action == StepAction.PAUSE:
            self.run.paused = True  # every rank holds after the step's boundary, until a resume
        records = [self._append(decision)]
        if triage == Triage.TRANSIENT:
            _count_transients(self.run.transients, ranks, {str(r): h for r, h in named.items()})
            records += self._judge_transients(step)
        self.changed = True
        return records

    def _judge_transients(self, step: int) -> list[dict]:
        """The rules on the transient counts, judged when they change (a run's last steps may all be
        evaluated before the record that changes them arrives)."""
        now, series = self._now(), Series({k: float(n) for k, n in self.run.transients.items()})
        records: list[dict] = []
        for monitor in self.monitors.values():
            if monitor.rule.metric == TRANSIENT_METRIC and monitor.observe(step, now, series):
                records += self._act(monitor, step, now)
        return records

    def transient_faults(self) -> dict[int, int]:
        """rank -> transient faults it produced in this run (the suspect-device metric)."""
        out: dict[int, int] = {}
        for key, n in self.run.transients.items():
            rank = int(key.split(",")[0].removeprefix("rank="))
            out[rank] = out.get(rank, 0) + n
        return out

    # -- requests and directives ----------------------------------------------------------------------

    def request(
        self,
        action: str,
        source: str,
        reason: str = "",
        to_step: int | None = None,
        skip_batches: int = 0,
        requested_by: str = "",
        rule: str | None = None,
    ) -> dict:
        """An operator's or Alertmanager's pause/resume/rollback; returns the decision record.

        A rollback without to_step goes to the newest known checkpoint. Alertmanager rollbacks
        count towards max_rollbacks like the rules' own. `rule`: the parwatch rule an alert
        mirrors (its `rule` label); if that rule already acted within its cooldown, the request
        is recorded but not enforced, so one failure does not get acted on twice.
        """
        _validate_request(action, source, to_step, skip_batches)
        if self.run_id is None:
            raise ValueError(
                "no run has reported to this sidecar yet, so there is nothing to "
                f"{action}; send the request once the run's rank 0 is shipping summaries here"
            )
        now, step = self._now(), self.run.last_step
        reason, note, escalated = reason or f"{action} requested by {source}", "", False
        if action == Action.ROLLBACK:
            to_step = self._resolve_checkpoint(to_step)
        mirrored = self.monitors.get(rule) if rule else None
        suppress = (
            source == DecisionSource.ALERTMANAGER
            and mirrored is not None
            and mirrored.acted_tick is not None
            and self.run.tick - mirrored.acted_tick < mirrored.rule.cooldown_steps
        )
        if suppress and mirrored is not None:
            note = f" (not enforced: rule {rule} already acted at step {mirrored.acted_step})"
        elif (
            action == Action.ROLLBACK
            and source == DecisionSource.ALERTMANAGER
            and (too_many := self._too_many_rollbacks())
        ):
            action, to_step, skip_batches, escalated, note = Action.PAUSE, None, 0, True, too_many
        elif action == Action.ROLLBACK:
            self.run.rollback_ticks.append(self.run.tick)
        decision = Decision(
            time=now,
            step=step,
            action=action,
            source=DecisionSource(source),
            requested_by=requested_by,
            reason=reason,
            evidence=RequestEvidence(to_step=to_step, skip_batches=skip_batches),
            checkpoint=to_step,
            skip_batches=skip_batches,
            escalated=escalated,
        )
        if rule:
            decision.alert_rule = rule
        if action == Action.RESUME:
            # A rule that paused the run and still fails must be able to act again after the
            # operator resumes (otherwise it stays "firing" and silent): firing -> pending, so
            # its next failing step fires it again, within its cooldown.
            rearm = sorted(
                name for name, m in self.monitors.items() if m.state == RuleState.FIRING and m.reason != NO_DATA
            )
            for name in rearm:
                self.monitors[name].state = RuleState.PENDING
                self.run.rearmed[name] = self.next_decision_id
            if rearm:
                decision.rearmed_rules = rearm
                note += f" (re-armed still-firing rules: {', '.join(rearm)})"
        decision.reason += note
        record = self._decide(decision, suppress=suppress)
        self.changed = True
        return record

    def _resolve_checkpoint(self, to_step: int | None) -> int:
        known = sorted(self.run.checkpoints)
        if not known:
            raise ValueError(
                "no checkpoint is known yet, so there is nothing to roll back to; "
                "wait for the run's first checkpoint (--checkpoint-every)"
            )
        if to_step is None:
            return known[-1]
        if to_step not in self.run.checkpoints:
            raise ValueError(
                f"to_step {to_step} is not a known verified checkpoint; the newest known are {known[-10:]}"
            )
        return to_step

    def pending_directive(self, deliver: bool = False) -> dict | None:
        """The current run's oldest directive without an outcome; None if none or not enforcing.
        deliver: it goes out to the run now (an ingest reply), after which it cannot be cancelled."""
        if not self.rules.enforce:
            return None
        pending = self.directives.oldest(self.run_id)
        if deliver and pending is not None and pending.delivered_at is None:
            pending.delivered_at = now = self._now()
            if pending.directive.action == Action.ROLLBACK:
                self.rollbacks_delivered += 1
            # Logged (not among the recent decisions): a state recovered from the log knows it went out.
            delivered = Delivered(
                directive_id=pending.directive.id,
                decision_id=pending.decision_id,
                time=now,
                step=self.run.last_step,
            )
            self.unsaved.append(log_record(delivered))
            self.changed = True  # with its record: once delivered it cannot be cancelled, also after a power loss
        return None if pending is None else pending.wire()

    def directive_states(self) -> list[dict]:
        """Every outstanding directive: {id, action, state: created | delivered, delivered_at}."""
        return [d.state() for d in self.directives.outstanding]

    def record_outcome(self, outcome: dict) -> list[dict]:
        """The run's outcome of a directive (every rank counted): write it down and act on it.

        `outcome`: {directive_id, run_id, outcome: applied | substituted | failed | ignored | mixed,
        step, loaded_step, counts, reasons, ranks[, local]}. A failed or mixed rollback escalates to a
        pause and an alert instead of unpausing. `local`: rank 0 made the directive itself while it could
        not reach this sidecar (parwatch/collector/fallback.py): its decision is recorded first, and the
        loss it acted on is judged after the outcome, as if its summary had arrived (the rules decide
        what follows: one rollback). Returns the records written (outcome first, but after a local decision)."""
        local: dict[str, Any] = outcome.get("local") or {}
        adopted = self._adopt_local(int(outcome["directive_id"]), local) if local else []
        records = adopted + self._record_outcome(outcome)
        if adopted and local.get("loss") is not None:
            records += self.evaluate(
                Observation(
                    step=int(local["step"]),
                    time=self._now(),
                    series={"loss": {"": float(local["loss"])}},
                    checkpoints=tuple(int(c) for c in local.get("checkpoints") or ()),
                )
            )
        return records

    def _adopt_local(self, did: int, local: dict) -> list[dict]:
        """Record rank 0's own decision (once: a resent record finds it in the log) and take its directive
        as delivered. Directives of this sidecar that rank 0 never took (ids after `local.after`, up to
        `did`) would be ignored by the ranks now: they get new ids above it."""
        if self.run_id is None or any(r.get("local") and r.get("directive_id") == did for r in self.recent):
            return []
        now = self._now()
        renumbered = self.directives.renumber(int(local.get("after") or 0), did)
        decided = local.get("time")
        reason = str(local.get("reason") or f"{local['rule']}: decided by rank 0")
        evidence = {
            "loss": jsonable(local.get("loss")),
            "decided_at": decided,
            "unreachable_since": local.get("unreachable_since"),
            "checkpoints": local.get("checkpoints"),
        }
        record = Decision(
            id=self.next_decision_id,
            run_id=self.run_id,
            time=now,
            step=int(local["step"]),
            rule=local["rule"],
            action=local["action"],
            source=DecisionSource.RANK0,
            enforced=True,
            reason=reason + " (decided by rank 0 while this sidecar was unreachable)",
            evidence=evidence,
            directive_id=did,
            local=True,
        )
        if renumbered:
            record.renumbered = renumbered
        self.directives.adopt(
            did,
            local["action"],
            self.run_id,
            reason,
            self.next_decision_id,
            delivered_at=decided if isinstance(decided, (int, float)) else now,
        )
        self.next_decision_id += 1
        return [self._append(record)]

    def _record_outcome(self, outcome: dict) -> list[dict]:
        now, result = self._now(), str(outcome.get("outcome"))
        did = int(outcome["directive_id"])
        done = self.directives.remove(did)
        if done is None:
            log.warning(
                "outcome %s of directive %d, which is not outstanding (cancelled, or reported "
                "twice): recorded, not acted on",
                result,
                did,
            )
            record = self._append(self._outcome_record(did, None, outcome, now))
            self.changed = True
            return [record]
        records = [self._append(self._outcome_record(did, done, outcome, now))]
        action = done.directive.action
        if result in (Outcome.APPLIED, Outcome.SUBSTITUTED):
            if action == Action.PAUSE:
                self.run.paused = True
            elif action in SWITCHES:
                # A rollback applied during a pause ends it: the trainer trains on after loading.
                self.run.paused, self.run.resumed_time = False, now
                self.last_switch = now
            if action == Action.ROLLBACK:
                # The trainer now replays from the checkpoint it loaded: later checkpoints belong to
                # the abandoned timeline, and the next step number may be one just evaluated.
                loaded = outcome.get("loaded_step")
                if loaded is not None:
                    self.run.checkpoints = {c for c in self.run.checkpoints if c <= int(loaded)}
                self.run.last_step = None
                self._switched(f"the rollback to step {loaded} (directive {did})", done.decision_id)
            elif action == Action.RESUME:
                self._switched(f"the resume (directive {did})", done.decision_id)
        elif result in (Outcome.FAILED, Outcome.MIXED) and action == Action.ROLLBACK:
            why = ", ".join(f"{k} on {v} ranks" for k, v in (outcome.get("reasons") or {}).items()) or result
            reason = (
                f"rollback (directive {did}) failed: {why}; the weights that failed are still loaded, "
                "so the run is paused for an operator"
            )
            evidence = RollbackFailedEvidence(
                directive_id=did, outcome=Outcome(result), reasons=outcome.get("reasons") or {}
            )
            for then in (Action.PAUSE, RuleAction.ALERT):
                decided = Decision(
                    time=now,
                    step=self.run.last_step,
                    action=then,
                    source=DecisionSource.ENGINE,
                    reason=reason,
                    evidence=evidence,
                    escalated=True,
                    failed_directive_id=did,
                )
                records.append(self._decide(decided))
        self.changed = True
        return records

    def _outcome_record(self, did: int, done: Outstanding | None, outcome: dict, now: float) -> Handled:
        ranks = int(outcome.get("ranks") or 0)
        directive = None if done is None else done.directive
        record = HANDLED[outcome["outcome"]](
            directive_id=did,
            action=self._action_of(did) if directive is None else directive.action,
            decision_id=None if done is None else done.decision_id,
            step=outcome.get("step"),
            time=now,
            ranks=f"0-{ranks - 1}" if ranks else "",
            rank_count=ranks,
            counts=outcome.get("counts") or {},
        )
        if directive is not None and directive.action == Action.ROLLBACK:
            record.requested_step = directive.to_step
            record.loaded_step = outcome.get("loaded_step")
            record.substituted = outcome.get("outcome") == Outcome.SUBSTITUTED
        if outcome.get("reasons"):
            record.reasons = outcome["reasons"]
        if directive is None:
            record.note = "not outstanding: cancelled, or reported twice"
        return record

    def _rearm_after_cancel(self, decision_id: int | None) -> list[str]:
        """The rule whose directive was cancelled acts again on its next failing step (firing -> pending);
        otherwise it would stay firing, acted on, and silent while it still fails."""
        if decision_id is None:
            return []
        made = self._decision("id", decision_id)
        monitor = self.monitors.get(made.get("rule") or "") if made is not None else None
        if monitor is None or monitor.state != RuleState.FIRING or monitor.reason == NO_DATA:
            return []
        monitor.state = RuleState.PENDING
        monitor.acted_tick = None  # the cancelled action did not happen: no cooldown from it
        self.run.rearmed[monitor.rule.name] = decision_id
        return [monitor.rule.name]

    def _decision(self, key: str, value: int) -> dict | None:
        """The newest recent decision whose `key` is `value`."""
        return next(
            (r for r in reversed(self.recent) if r.get("type") == RecordType.DECISION and r.get(key) == value), None
        )

    def _action_of(self, did: int) -> str | None:
        """The action of a directive no longer outstanding, from the decision that made it (None: unknown)."""
        made = self._decision("directive_id", did)
        return str(made["action"]) if made is not None else None

    def cancel(self, directive_id: int, requested_by: str = "") -> dict:
        """Withdraw a directive not yet delivered to the run; DirectiveDelivered once it has been (the
        ranks will apply it), ValueError if there is none with that id."""
        pending = self.directives.find(directive_id)
        if pending is not None and pending.delivered_at is not None:
            raise DirectiveDelivered(
                f"directive {directive_id} ({pending.directive.action}) was delivered to the run at "
                f"{pending.delivered_at:.3f}: every rank applies it at its next step boundary and it can no "
                "longer be cancelled; undo it once applied (e.g. resume after a pause)",
                pending.state(),
            )
        done = self.directives.remove(directive_id)
        if done is None:
            outstanding = [d.directive.id for d in self.directives.outstanding]
            raise ValueError(
                f"directive {directive_id} is not outstanding (outstanding: {outstanding or 'none'})"
                "; it may already have been applied: see parwatch decisions"
            )
        rearmed = self._rearm_after_cancel(done.decision_id)
        cancelled = Cancelled(
            directive_id=directive_id,
            action=done.directive.action,
            decision_id=done.decision_id,
            time=self._now(),
            requested_by=requested_by,
            step=self.run.last_step,
        )
        if rearmed:
            cancelled.rearmed_rules = rearmed
        record = self._append(cancelled)
        self.changed = True
        return record

    # -- runs -----------------------------------------------------------------------------------------

    def is_new_run(self, run_id: str) -> bool:
        """Whether `run_id` is another run than the current one; ValueError for one that already ended here
        (a late post of an old run is not taken back)."""
        if run_id in self.archived_runs:
            raise ValueError(
                f"run {run_id!r} already ended here (its state is archived); "
                "a trainer of that run must not report any more"
            )
        return run_id != self.run_id

    def begin_run(self, run_id: str) -> None:
        """`run_id` is the run now: the current one (if any) ended, and its state starts afresh (the ids go
        on: a trainer ignores an id at or below the last it handled). The engine saved its last state before."""
        if self.run_id is not None:
            self.archived_runs.add(self.run_id)
            self.monitors = {r.name: RuleMonitor(r) for r in self.rules.rules}
            self.recent.clear()
            self.directives = Directives(first_id=self.directives.next_id)
            self.run, self.rollbacks_delivered = RunState(), 0
        self.run_id = run_id

    def ended(self, run_id: str) -> bool:
        """Whether `run_id` ran here and ended (its state archived)."""
        return run_id in self.archived_runs

    # -- rules, state and views -----------------------------------------------------------------------

    def reload(self, rules: RuleSet) -> None:
        """Swap in new rules; a rule whose name survives keeps its state (and baseline, if still valid)."""
        monitors = {}
        for rule in rules.rules:
            monitors[rule.name] = RuleMonitor(rule)
            old = self.monitors.get(rule.name)
            if old is not None:
                monitors[rule.name].restore(old.to_dict())
        self.rules, self.monitors = rules, monitors
        self._metrics = {r.metric for r in rules.rules}

    def states(self) -> dict[str, dict]:
        """name -> the rule's state (NaN/inf values as the schema's strings, so it is JSON-safe)."""
        return {
            name: {
                "state": m.state,
                "reason": m.reason,
                "failing_steps": m.failing_steps,
                "since_step": m.since_step,
                "last_value": jsonable(m.last_value),
                "threshold": jsonable(m.threshold),
                "last_seen_time": m.last_seen_time,
                "metric": m.rule.metric,
                "action": m.rule.action,
                "series": m.last_series,
            }
            for name, m in self.monitors.items()
        }

    def decisions(self, limit: int = 100) -> list[dict]:
        """The newest `limit` records of the decision log (decisions and applied), newest last."""
        return list(self.recent)[-limit:] if limit > 0 else []

    # -- the saved state (the store's rows, or what decisions.jsonl says when they are lost) ------------

    def snapshot(self) -> tuple[dict, dict, list[dict]]:
        """What the store keeps of the current run: its row, its rules' states (the baseline windows apart:
        baselines()) and its outstanding directives."""
        run = self.run
        state = {
            "paused": run.paused,
            "tick": run.tick,
            "last_step": run.last_step,
            "first_seen_time": run.first_seen_time,
            "resumed_time": run.resumed_time,
            "next_directive_id": self.directives.next_id,
            "checkpoints": sorted(run.checkpoints)[-MAX_CHECKPOINTS:],
            "rollback_ticks": run.rollback_ticks,
            "rearmed": run.rearmed,
        }
        rules = {name: m.to_dict(history=False) for name, m in self.monitors.items()}
        return state, rules, [d.saved() for d in self.directives.outstanding]

    def baselines(self) -> dict[str, dict]:
        return {name: m.baseline_dict() for name, m in self.monitors.items()}

    def restore(self, saved: dict) -> None:
        """Continue from a saved state (StateStore.load): the run, its newest records, its outstanding
        directives and the next ids; rule states and baselines where saved and usable (else afresh)."""
        run = saved.get("run") or {}
        self.run_id, self.archived_runs = run.get("run_id"), set(saved.get("archived", ()))
        self.run = RunState(
            paused=bool(run.get("paused")),
            tick=run.get("tick") or 0,
            last_step=run.get("last_step"),
            first_seen_time=run.get("first_seen_time"),
            resumed_time=run.get("resumed_time"),
            checkpoints=set(run.get("checkpoints", ())),
            rollback_ticks=list(run.get("rollback_ticks", ())),
            rearmed=dict(run.get("rearmed", {})),
        )
        self.recent.extend(r for r in saved.get("records", ()) if r.get("type") != RecordType.DELIVERED)
        for r in self.recent:  # the suspect-device counts the recorded checks made
            if r.get("source") == DecisionSource.STEP_CHECK and r.get("triage") == Triage.TRANSIENT:
                _count_transients(
                    self.run.transients, r.get("ranks") or (), (r.get("evidence") or {}).get("hosts") or {}
                )
        self.next_decision_id = saved.get("next_decision_id", 1)
        self.directives.restore(saved.get("directives", []), saved.get("next_directive_id"))
        self.rollbacks_delivered = sum(  # handed out before a restart: the run may apply them after it
            1
            for d in self.directives.outstanding
            if d.directive.action == Action.ROLLBACK and d.delivered_at is not None
        )
        for table in ("rules", "baselines"):
            for name, text in saved.get(table, {}).items():
                monitor = self.monitors.get(name)
                if monitor is None:
                    continue
                try:
                    (monitor.restore if table == "rules" else monitor.restore_baseline)(json.loads(text))
                except (AttributeError, KeyError, TypeError, ValueError) as err:  # edited by hand
                    what = "state" if table == "rules" else "baseline"
                    log.warning("rule %s's saved %s in %s is not usable (%s): it starts afresh", name, what, table, err)
                    if table == "rules":
                        self.monitors[name] = RuleMonitor(monitor.rule)
                    else:
                        monitor.reset_baseline()


def _count_transients(counts: dict[str, int], ranks, hosts: dict[str, str]) -> None:
    """One transient fault more in each rank's suspect-device series, "rank=R[,host=H]" (hosts: str(rank) -> H)."""
    for rank in ranks:
        key = f"rank={rank}" + (f",host={hosts[str(rank)]}" if str(rank) in hosts else "")
        counts[key] = counts.get(key, 0) + 1


def _numbers(values) -> dict[str, float]:
    """The usable series of one metric: numbers, or the schema's "nan"/"inf"/"-inf"; None and junk dropped.

    The common case (str keys, float values, as the sidecar builds them) is returned as is:
    nothing downstream keeps or changes the dict.
    """
    if not values:
        return {}
    if type(values) is dict and set(map(type, values.values())) == {float} and set(map(type, values)) == {str}:
        return values
    out = {}
    for key, value in (values or {}).items():
        try:
            number = decode_float(float(value) if isinstance(value, bool) else value)
        except ValueError:
            continue
        if number is not None:
            out[str(key)] = number
    return out


def _validate_request(action, source, to_step, skip_batches) -> None:
    if action not in DIRECTIVE_ACTIONS:
        raise ValueError(f"action {action!r} is not one of {', '.join(DIRECTIVE_ACTIONS)}")
    if source not in REQUEST_SOURCES:
        raise ValueError(f"source {source!r} is not one of {', '.join(REQUEST_SOURCES)}")
    if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or not 0 <= skip_batches < MAX_STEP:
        raise ValueError(f"skip_batches must be an integer in 0..2**53-1, got {skip_batches!r}")
    if to_step is not None and (
        isinstance(to_step, bool) or not isinstance(to_step, int) or not 0 <= to_step < MAX_STEP
    ):
        raise ValueError(f"to_step must be a checkpoint step (an integer in 0..2**53-1) or None, got {to_step!r}")
    if action != Action.ROLLBACK and (to_step is not None or skip_batches):
        raise ValueError(f"to_step and skip_batches apply to rollback only, not to {action}")
