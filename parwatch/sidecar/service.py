"""The sidecar's behaviour, free of HTTP: ingest, control, alerts, status, rules reload.

app.py maps requests onto these methods. They run on one event loop (or one test
thread), so writes never race; a /metrics scrape interleaved with them reads only
immutable values (store.py).

The event loop never waits for a disk: the engine defers its writes and `persist()` commits
them in one writer thread (before the request that made a decision is answered, so before any
directive it made is handed out). A post of many summaries gives other requests a turn between
its summaries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from parwatch import ledger_view
from parwatch.credentials import OPERATOR, Identity
from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.engine_store import StorageFault
from parwatch.guardrails.rules import RulesError, default_rules, load_rules
from parwatch.sidecar.alerts import AlertDedupe
from parwatch.sidecar.claims import Refused
from parwatch.sidecar.config import ConfigError, SidecarConfig, ensure_token
from parwatch.sidecar.exporter import SidecarCounters, make_registry
from parwatch.sidecar.observations import build_observation
from parwatch.sidecar.pid_owner import Connection, Proofs
from parwatch.sidecar.rank_gauges import RankGauge
from parwatch.sidecar.refusals import Refusals
from parwatch.sidecar.requeue import SlurmJob, SlurmRequeue
from parwatch.sidecar.store import Store
from parwatch.sidecar.transfer import TransferTracker
from parwatch.vocabulary import DecisionSource, RecordType, RuleAction, SidecarRole, Speaker, jsonable
from parwatch.wire.bodies import AlertmanagerPayload, ControlRequest
from parwatch.wire.steps import IngestBody

log = logging.getLogger(__name__)
MAX_UNJUDGED = 10_000


class Sidecar:
    def __init__(self, config: SidecarConfig, engine, clock: Callable[[], float] = time.time):
        self.config = config
        self.engine = engine
        self.clock = clock
        self.store = Store(config.rank_grace_seconds, clock=clock, max_ranks=config.max_ranks, max_runs=config.max_runs)
        self.store.rollbacks = lambda run_id: engine.rollbacks_delivered if run_id == engine.run_id else None
        self.proofs = Proofs()
        """Which process holds each rank's connection (claims.py): proven once per connection and pid."""
        self._unjudged: set[tuple[str, int, int]] = set()
        """(run, timeline, step) of rank 0's views whose judgement a failed write undid: judged again when the
        post comes back (the store counted them, so a retry would otherwise pass as already judged)."""
        self.counters = SidecarCounters()
        self.transfer = TransferTracker()
        self.registry = make_registry(
            self.store, engine, self.counters, self.transfer, judges_rules=lambda: self.rules_judged_by() is None
        )
        self.refusals = Refusals(clock)
        """Posts refused (a wrong token, a bad body), counted, logged and in status (gate.RequestGate tells them)."""
        self.registry.register(self.refusals)
        self.rank_gauges = {"parwatch_rank_up": RankGauge("parwatch_rank_up", self.store.liveness)}
        """Gauges with a series per rank, rendered apart from the registry (rank_gauges.py): /metrics has both."""
        self.alerts = AlertDedupe(engine.acted_alerts(), engine.note_alert)
        self.exports = None
        """The experiment trackers this sidecar writes to (`--export`; parwatch/sidecar/trackers), or None."""
        if config.exports:
            from parwatch.sidecar.trackers.exports import Exports  # no tracker code without --export

            self.exports = Exports(self, config.exports, config.export_every_steps)
        job = SlurmJob(config.slurm_job_id, config.slurm_restarts) if config.slurm_job_id else None
        self.requeue = SlurmRequeue(job, config.max_requeues)
        """Carries out requeue decisions (a rule's, or the hang's with --hang-requeue): requeue.py."""
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._last_write: asyncio.Future | None = None

    # -- disk -------------------------------------------------------------------------------
    def defer_writes(self) -> None:
        """Serve mode: engine writes go to one writer thread (persist()) instead of the caller's."""
        self.engine.defer_writes()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parwatch-writer")

    async def persist(self, epoch: int | None = None) -> None:
        """Everything the engine decided so far is committed when this returns, including batches another
        request handed to the writer before us (the writer is one FIFO thread, so waiting for the newest
        submitted write waits for all). StorageFault when it could not be: the engine has then put back
        its last committed state (nothing decided since stands, no directive of it goes out), and the
        request answers 503. epoch: the engine's epoch when the request began; a request whose work was
        put back by another's failed write (the epoch moved) is told so too."""
        if self._writer is not None:
            batch = self.engine.take_writes()  # ours, and whatever else is owed
            if batch:
                self._last_write = asyncio.get_running_loop().run_in_executor(self._writer, batch.write)
            pending = self._last_write
            if pending is not None:
                try:
                    await asyncio.shield(pending)  # a client hanging up must not cancel a write
                except StorageFault:
                    self.engine.recover()
                    self.alerts.reload(self.engine.acted_alerts())
                    raise
                finally:
                    if self._last_write is pending and pending.done():
                        self._last_write = None
        if epoch is not None and self.engine.epoch != epoch:
            raise StorageFault(
                "the state dir failed a write while this request was decided: what it decided was undone; retry"
            )

    def close(self) -> None:
        """Last writes, on the caller's thread (shutdown)."""
        if self.exports is not None:
            self.exports.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.engine.close()

    # -- writes -----------------------------------------------------------------------------
    def ingest(self, body: IngestBody, identity: Identity = OPERATOR, client: Connection | None = None) -> dict:
        """Store a post's summaries and evaluate; Refused (with the HTTP status) when the store
        will not hold them. The answer's directive is read after the work."""
        pids, held = self._admit(body, identity, client)
        for i, (s, pid) in enumerate(zip(body.summaries, pids)):
            if i not in held:
                self._ingest_one(s, pid)
        self._record_checks(body)
        return self.ingest_reply(body, held)

    async def ingest_async(
        self, body: IngestBody, identity: Identity = OPERATOR, client: Connection | None = None
    ) -> dict:
        """ingest(), letting other requests in between summaries (a post may carry 10,000, each a step
        to evaluate), then persisting what the engine decided before the answer, and the delivery of the
        directive the answer carries (from then on it cannot be cancelled). StorageFault (503) when the
        state dir cannot be written: no directive goes out then."""
        epoch = self.engine.epoch
        pids, held = self._admit(body, identity, client)
        for i, (s, pid) in enumerate(zip(body.summaries, pids)):
            if i:
                await asyncio.sleep(0)
            if i not in held:
                self._ingest_one(s, pid)
        self._record_checks(body)
        try:
            await self.persist(epoch)
        except StorageFault:
            if len(self._unjudged) > MAX_UNJUDGED:
                self._unjudged.clear()
            self._unjudged.update(
                (s.run_id, *s.key) for i, s in enumerate(body.summaries) if s.global_ is not None and i not in held
            )
            raise
        reply = self.ingest_reply(body, held)
        await self.persist(epoch)
        return reply

    def ingest_reply(self, body: IngestBody, held: dict[int, str] | None = None) -> dict:
        reply: dict = {"accepted": len(body.summaries) - len(held or ())}
        if held:
            reply["refused"] = self.refusals.held("/v1/ingest", held, str(len(body.summaries)))
        reply["directive"] = self.engine.pending_directive(deliver=True)
        return reply

    def _admit(
        self, body: IngestBody, identity: Identity = OPERATOR, client: Connection | None = None
    ) -> tuple[list[int | None], dict[int, str]]:
        """Check the whole post (who it speaks for, then the store's admission); the pid each summary's
        connection proves (None: unproven), and the summaries held back ({index: why}: Store.admit)."""
        _speaks_for(identity, body)
        hub = getattr(self, "activity", None)
        if hub is not None and body.summaries and body.summaries[0].run_id != self.store.run_id:
            # Another run's summaries: the last one may have ended with the previous post (its done ranks'
            # last summaries), which the once-a-second tick has not yet seen: CI refused the next run 409.
            hub.note_if_ended()
        for i, s in enumerate(body.summaries):
            if s.run_id != self.engine.run_id and self.engine.ended(s.run_id):
                raise Refused(
                    409,
                    f"summaries.{i}.run_id: run {_printable(s.run_id)[:64]!r} already ended here (its state is "
                    "archived) and is not taken back; resume it under a new run id (--run-id), so that it is "
                    "judged again",
                )

        def prove(pid: int | None) -> float | None:
            return self.proofs.started(pid, client)

        held = self.store.admit(body.summaries, prove=prove)
        # A check record belongs to the run whose summaries come here: this post's (its first step may be
        # the bad one) or the current one. One of a run not begun yet (its summaries refused or still to
        # come) is refused, so rank 0 sends it again; one of a run that ended here is late, and ignored.
        runs = {self.engine.run_id} | ({body.summaries[0].run_id} if body.summaries else set())
        for i, check in enumerate(body.checks):
            if check.run_id not in runs and not self.engine.ended(check.run_id):
                raise Refused(
                    409,
                    f"checks.{i}.run_id: run {_printable(check.run_id)[:80]} has not begun here; "
                    "its first summary must come first",
                )
        rank0 = self.store.ranks.get(0)
        said = "outcomes" if body.outcomes else "checks" if body.checks else "alive" if body.alive else None
        if said and rank0 is not None and rank0.pid is not None and prove(rank0.pid) is None:
            raise Refused(
                409,
                f"{said}: rank 0's word for every rank, and rank 0's process here is pid {rank0.pid}, proven by "
                "its own connection; this post does not come from it",
            )
        pids = [
            s.pid if s.pid is not None and _agrees(prove(s.pid), s.process_start_time) else None for s in body.summaries
        ]
        if body.alive:
            # A paused run sends no summaries; rank 0 polls instead, and says "alive" only when a
            # heartbeat collective (which every rank must join, and only while paused) completed since
            # its last post. Without this a long operator pause would read as dead ranks, or as a hang
            # (to a restarted leader that has not yet heard of rank 0's own pause).
            if self.engine.paused:
                self.store.touch_all()
            hub = getattr(self, "activity", None)
            if hub is not None:
                hub.heartbeat_at = self.clock()
        for outcome in body.outcomes:
            if outcome.local is not None and self.engine.run_id is None:
                try:  # a leader that lost its state: rank 0's own decision still belongs to a run
                    self.engine.begin_run(outcome.run_id)
                except ValueError as err:
                    log.warning("rank 0's local decision refused: %s", err)
            if outcome.run_id == self.engine.run_id:
                self._count(self.engine.record_outcome(msgspec.to_builtins(outcome)))
            else:
                log.warning(
                    "outcome of directive %d for run %s, not the current run: ignored",
                    outcome.directive_id,
                    _printable(outcome.run_id),
                )
        return pids, held

    def _record_checks(self, body: IngestBody) -> None:
        """The post's check records, after its summaries (which may begin their run)."""
        for check in body.checks:
            if check.run_id == self.engine.run_id:
                self._count(self.engine.record_check(msgspec.to_builtins(check), self._hosts(check.ranks)))
            else:
                log.warning(
                    "check record of step %d for run %s, which ended here: ignored",
                    check.step,
                    _printable(check.run_id),
                )

    def _hosts(self, ranks: list[int]) -> dict[int, str]:
        """rank -> host for the ranks the run's activity names (the leader's view of every node)."""
        hub = getattr(self, "activity", None)
        if hub is None or not ranks:
            return {}
        rows = hub.rows()
        return {r: rows[r].host for r in ranks if r in rows and rows[r].host}

    def _ingest_one(self, s, pid: int | None = None) -> None:
        if s.run_id != self.store.run_id:
            self.store.admit([s])  # another post switched runs while this one waited
        if s.rank == 0 and s.run_id != self.engine.run_id:
            try:
                self.engine.begin_run(s.run_id)  # a new run: a clean engine (the old one archived)
            except ValueError as err:
                log.warning("summary refused: %s", err)
                return
        if not self.store.add(s, pid):
            if s.global_ is not None and self._unjudged and (s.run_id, *s.key) in self._unjudged:
                self._unjudged.discard((s.run_id, *s.key))  # counted, but its judgement was undone: judge it now
                self.store.global_view = s.global_
                self._evaluate()
            return  # a retried post: already counted and evaluated
        hub = getattr(self, "activity", None)
        self.transfer.add(s, self._cpu_wait(hub, pid, s.step_seconds))
        if s.rank == 0 and hub is not None and not hub.is_leader:
            hub.saw_rank0()  # now, not at the next tick: a short run's points and gauges are the leader's from its start
        # Rank 0 sends one summary per step, so a new one carrying the fast-path view is a new
        # global step (retries stopped above; the engine also ignores a repeated step).
        if s.global_ is not None and self.store.global_view is s.global_:
            self._evaluate()
        if self.exports is not None:
            self.exports.after_summary(s.step)

    def _cpu_wait(self, hub, pid: int | None, step_seconds: float) -> float | None:
        """Seconds a second the summary's process (proven here: a pid of this host) waited for a CPU over about
        the attribution's window (sampled by the activity tick; None without it)."""
        if hub is None or pid is None:
            return None
        return hub.book.cpu_waits.per_second(pid, self.transfer.window_steps * step_seconds)

    def _evaluate(self) -> None:
        obs = build_observation(self.store)
        if obs is not None:
            obs.series.update(self.transfer.take_series())
            self._count(self.engine.evaluate(obs))

    def cancel(self, directive_id: int, requested_by: str = DecisionSource.OPERATOR) -> dict:
        """Withdraw an outstanding directive; ValueError when there is none with that id."""
        return self.engine.cancel(directive_id, requested_by)

    def control(self, req: ControlRequest, requested_by: str = DecisionSource.OPERATOR) -> dict:
        """An operator's pause/resume/rollback; ValueError when the engine refuses it, or when this is a
        node sidecar (its guardrails are the leader's: the message names it)."""
        hub = getattr(self, "activity", None)
        if self.config.leader_url and hub is not None and not hub.is_leader:
            raise ValueError(
                f"this sidecar forwards to the run's leader and does not steer the run; send "
                f"{req.action} to the leader: parwatch {req.action} --endpoint {self.config.leader_url}"
            )
        decision = self.engine.request(
            req.action,
            source=DecisionSource.OPERATOR,
            reason=req.reason,
            to_step=req.to_step,
            skip_batches=req.skip_batches,
            requested_by=req.requested_by or requested_by,
        )
        self._count([decision])
        return decision

    def alert_webhook(self, payload: AlertmanagerPayload) -> list[dict]:
        def request(action, **kw):
            return self.engine.request(action, source=DecisionSource.ALERTMANAGER, **kw)

        decisions = self.alerts.handle(payload, request)
        self._count(decisions)
        return decisions

    def tick(self) -> list[dict]:
        """Ask the engine about rules whose metric went silent; the server calls this every second."""
        hub = getattr(self, "activity", None)
        decisions = self.engine.check_no_data(paused=hub is not None and hub.run_paused())
        self._count(decisions)
        if self.exports is not None:
            self.exports.tick()
        return decisions

    def reload_rules(self) -> bool:
        """Re-read the rules file (SIGHUP). An invalid file keeps the old rules and counts a failure."""
        path = self.config.rules_path
        try:
            rules = load_rules(path) if path is not None else default_rules()
            check_requeue_rules(rules, self.config)
        except (RulesError, OSError, ConfigError) as err:
            self.counters.rules_reload_failures += 1
            for line in str(err).splitlines():
                log.error("rules reload refused, keeping the old rules: %s", line)
            return False
        self.engine.reload(rules)
        log.info("rules reloaded from %s", path or "the packaged defaults")
        return True

    def _count(self, decisions) -> None:
        """Count the decisions made, and hand the requeues among them to the requeuer (it carries them out)."""
        self.requeue.take(decisions)
        for d in decisions or ():
            if d and d.get("type", "decision") == RecordType.DECISION and d.get("action"):  # not outcome records
                self.counters.actions[(str(d.get("rule") or d.get("source") or "operator"), str(d["action"]))] += 1

    # -- reads ------------------------------------------------------------------------------
    def rules_judged_by(self) -> str | None:
        """None where this sidecar judges the run's rules; else who does (a node sidecar's leader). A node
        judges no rule: its engine's states would read "ok" beside a NaN, in status and on /metrics."""
        hub = getattr(self, "activity", None)
        link = hub.link.status(hub.is_leader) if hub is not None else None
        if link is None or link["role"] == SidecarRole.LEADER:
            return None  # the leader, or a sidecar alone (a one-node run)
        return link["url"] or "the run's leader (no --leader-url)"

    def status(self, decisions: int = 10) -> dict:
        head = self.store.run_summary()
        run = None
        if head is not None:
            run = {k: getattr(head, k) for k in ("run_id", "schedule", "tp", "pp", "dp", "microbatches", "chunks")}
        live = self.store.liveness()
        ranks = {
            str(rank): {
                "last_step": rec.summary.step,
                "age_seconds": round(self.store.age(rec), 3),
                "up": live.get(rank, self.store.is_up(rec)),
            }
            for rank, rec in sorted(self.store.ranks.items())
        }
        hub = getattr(self, "activity", None)
        link = hub.link.status(hub.is_leader) if hub is not None else None
        judged_by = self.rules_judged_by()
        judged_here = judged_by is None
        return jsonable(
            {
                "run": run,
                "last_step": self.store.last_step,
                "ranks": ranks,
                "leader_link": link,
                "refused": self.refusals.status(),
                "rules_judged_by": judged_by,
                "rules": self.engine.states() if judged_here else None,
                "paused": self.engine.paused if judged_here else (hub.leader_paused if hub is not None else None),
                "pending_directive": self.engine.pending_directive(),
                "directives": self.engine.directive_states(),
                "last_decisions": self.engine.decisions(decisions),
                "evidence": hub.evidence.status()[-5:] if hub is not None else [],
                "time": ledger_view.totals(self.store.ledgers().values()),
            }
        )

    def decisions(self, limit: int) -> list:
        return jsonable(self.engine.decisions(limit))


def _agrees(real: float | None, claimed: float | None) -> bool:
    return real is not None and claimed is not None and ledger_view.same_process(real, claimed)


def _speaks_for(identity: Identity, body: IngestBody) -> None:
    """Refused (403) unless a rank's credential speaks for every summary, outcome and check record of the post:
    its own rank and run; outcome and check records and "alive" (rank 0's word for every rank) are rank 0's."""
    if identity.speaker == Speaker.OPERATOR:
        return
    who = identity.describe()
    if identity.speaker != Speaker.RANK:
        raise Refused(403, f"a credential of {who} posts no step summaries")
    for i, s in enumerate(body.summaries):
        if s.rank != identity.rank or s.run_id != identity.run_id:
            raise Refused(
                403,
                f"summaries.{i}: rank {s.rank} of run {_printable(s.run_id)[:64]!r}, but this credential speaks "
                f"for {who} only",
            )
    for i, o in enumerate(body.outcomes):
        if identity.rank != 0 or o.run_id != identity.run_id:
            raise Refused(403, f"outcomes.{i}: outcome records are rank 0's of their run; this credential is {who}'s")
    for i, c in enumerate(body.checks):
        if identity.rank != 0 or c.run_id != identity.run_id:
            raise Refused(403, f"checks.{i}: check records are rank 0's of their run; this credential is {who}'s")
    if body.alive and identity.rank != 0:
        raise Refused(403, f"alive: only rank 0 vouches for every rank (its heartbeat); this credential is {who}'s")


def _printable(text: str) -> str:
    """Control characters escaped: a client's string must not forge log lines."""
    return text.encode("unicode_escape").decode("ascii")


def check_requeue_rules(rules, config: SidecarConfig) -> None:
    """A rule whose action is requeue needs the Slurm job it would requeue: ConfigError naming the rules."""
    requeuing = [r.name for r in rules.rules if r.action == RuleAction.REQUEUE]
    if requeuing and config.slurm_job_id is None:
        raise ConfigError(
            f"rules {requeuing} have action requeue, which requeues the Slurm job the sidecar runs in: start it "
            "inside the job (srun sets SLURM_JOB_ID) or pass --slurm-job-id ID"
        )


def build_sidecar(config: SidecarConfig, clock: Callable[[], float] = time.time) -> Sidecar:
    """Load the rules (RulesError names every problem) and start the engine on the state dir.

    Writes are authenticated by default: without a token the sidecar uses STATE_DIR/token,
    creating it (random, mode 0600) on first start (TokenError if it is readable by others)."""
    rules = load_rules(config.rules_path) if config.rules_path is not None else default_rules()
    check_requeue_rules(rules, config)
    Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    if config.token is None:
        token, path, _ = ensure_token(config.state_dir)  # server.serve logs where it is
        config = dataclasses.replace(config, token=token, token_file=path)
    engine = GuardrailEngine(rules, Path(config.state_dir), now=clock)
    return Sidecar(config, engine, clock=clock)
