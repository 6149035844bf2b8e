"""The sidecar's live-activity face: POST /v1/activity (ranks), POST /v1/digest (node sidecars to
the leader), GET /v1/hang; and the loop that judges liveness and hangs.

`install(app, sidecar)` is all app.py does: it adds these routes (authenticated like /v1/ingest),
a lifespan task for the loop, and the hang metrics to the sidecar's registry.

Every second (`ActivityHub.tick`):
- every sidecar feeds the rank-missing rule (and parwatch_rank_up) the ranks' liveness, so that
  rule fires on time even when no rank reports any more. Activity first: a rank whose activity
  says it runs is up (computing, waiting on a peer, or paused), one whose process ended or went
  silent is down, and only a rank without activity is judged by its summaries. The leader judges
  every rank it has a digest of, so rank-missing sees the whole world and never names a rank that
  merely waits on another (a hang is the hang rule's);
- a sidecar that is not the leader forwards its node digest to --leader-url, then the collective
  and p2p instances that span nodes, for the leader to match (parwatch/sidecar/crossnode.py), and
  says when the leader is unreachable, refuses it, or is not configured in a larger run
  (parwatch/sidecar/leader_link.py).
Every JUDGE_EVERY_SECONDS (0.25 s; `ActivityHub.judge`) the leader (it saw rank 0) asks the hang
monitor whether anything is due, and only then runs it over its own ranks and every digest: the
ask is two numbers, and asking often is what lets a hang be named within its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from msgspec.structs import replace as replace_fields

from parwatch.credentials import Identity, Verifier, node_credential
from parwatch.guardrails.engine_store import StorageFault
from parwatch.host import host_identity
from parwatch.rank_layout import RankLayout
from parwatch.sidecar import crossnode
from parwatch.sidecar.auth import bearer_dependency, identity_of
from parwatch.sidecar.bodies import documented
from parwatch.sidecar.claims import CLOCK_SKEW_SECONDS
from parwatch.sidecar.digest import (
    BadActivity,
    LeaderView,
    NodeBook,
    StepPace,
    check_times,
    in_layout,
    layout_of,
    same_layout,
)
from parwatch.sidecar.evidence import EvidenceBook, EvidenceRefused
from parwatch.sidecar.exits import ProcessExits
from parwatch.sidecar.hang import (
    ENDED,
    JUDGE_EVERY_SECONDS,
    MAX_LISTED,
    SURVEY_PAUSE_SECONDS,
    SURVEY_SLICE,
    HangMetrics,
    HangMonitor,
    HangSettings,
)
from parwatch.sidecar.leader_link import LeaderLink, LeaderLinkMetrics
from parwatch.sidecar.observations import rank_key
from parwatch.sidecar.pid_owner import Connection, connection_of, owns_connection
from parwatch.sidecar.rank_gauges import RankGauge
from parwatch.vocabulary import BuiltinRule, RankState, RuleAction, Speaker, jsonable
from parwatch.wire.activity import HANG_EXIT_CODE, Activity, ActivityPost, NodeDigest
from parwatch.wire.codec import BadRecord, decode, encode
from parwatch.wire.evidence import EvidencePost, RankEvidence
from parwatch.wire.findings import HangEvidence, bundle_of, finding_evidence

log = logging.getLogger(__name__)
TICK_SECONDS = 1.0
"""Liveness, forwarding and cross-node expiry: once a second (a digest per node per second)."""
RawPost = Callable[..., Awaitable[tuple[int, Any]]]
"""A raw-body handler: raw bytes (and the connection's `client`, the credential's `identity`) -> (status, JSON payload)."""
SMALL_POST = 64 * 1024
"""Hot posts up to this size are decoded on the event loop; larger ones in a thread (a 7 MB digest held the
loop 1.6 s)."""
FINAL_SUMMARIES_SECONDS = 5.0
"""How long the run's end waits for the last summaries of ranks that said done (a shipper closes in 2 s)."""
HEARTBEAT_SECONDS = 5.0
"""Rank 0 said "alive" (a heartbeat boundary: the run is paused) this recently: a stall is no hang."""


class Forbidden(BadRecord):
    """A credential speaking for another rank, node or run than the report is of (403)."""


class Conflict(BadRecord):
    """A report of another run while this sidecar's run is live (409)."""


class ActivityHub:
    """One sidecar's activity state: its ranks (NodeBook), and at the leader every node's digest."""

    def __init__(self, sidecar, http=None, hostname: str | None = None):
        cfg = sidecar.config
        self.sidecar = sidecar
        self.clock = sidecar.clock
        self.hostname = hostname or host_identity()
        """This node's host, as its ranks report it ($PARWATCH_HOST): theirs are the pids it can check."""
        self.node = f"{socket.gethostname()}:{cfg.control_listen.port}"
        """This sidecar's name at the leader: its own hostname (a pod's name: unique where the host is shared)."""
        self.book = NodeBook(self.clock, cfg.activity_silent_seconds, self.hostname, exits=ProcessExits(self.clock))
        self.pace = StepPace(self.clock)
        """The run's highest step, shared by its ranks' activity and the nodes' digests."""
        self.view = LeaderView(self.clock, max(5.0, 5 * TICK_SECONDS), pace=self.pace)
        self.settings = HangSettings(
            cfg.hang_min_seconds,
            cfg.hang_step_factor,
            cfg.hang_busy_seconds,
            dump_stacks=cfg.hang_dump_stacks,
            abort=cfg.hang_abort,
            requeue=cfg.hang_requeue,
        )
        self.evidence = EvidenceBook(cfg.state_dir, self.clock)
        """The decisions whose ranks' evidence is asked for, and (at the leader) where it is kept."""
        self.monitor = HangMonitor(self.settings, sidecar.engine, self.clock, requeue=sidecar.requeue)
        self.leader_url = cfg.leader_url.rstrip("/") if cfg.leader_url else None
        self.is_leader = False
        """Set on the first sign of rank 0 (its activity or its summaries) at a sidecar started without
        --leader-url: a role is decided by configuration and the run, never by one report."""
        self.restarted = sidecar.engine.run_id is not None
        """This sidecar started on a state dir that holds a run: a restarted leader, which missed what happened
        while it was down."""
        self.quiet_until: float | None = None
        """A restarted leader judges nothing before this: one grace period after it heard from rank 0 again
        (every node has spoken by then), so its own downtime is never read as the run's silence."""
        self.heartbeat_at: float | None = None
        """When rank 0 last said "alive" (a heartbeat boundary: the run is paused, whatever the engine knows)."""
        self._to_act: list[dict] = []
        """Hang records to act on (stacks, abort) once they are committed: never an action without its record."""
        self._epoch = sidecar.engine.epoch
        self._committed: tuple = (None, frozenset(), None)
        """The hang monitor's (hang, gone_reported, cause) as of the last committed write (put back after a
        failed one)."""
        self.abort = False
        """Set when the leader decided to abort the run: activity replies tell the ranks to exit."""
        self._signals: dict[str, list[int]] = {}  # node -> pids the leader wants signalled there
        self._proven: dict[int, tuple[int, bool]] = {}
        """rank -> (pid, whether that pid's own process sent the report): only a proven pid is ever signalled."""
        self._node_of: dict[int, str] = {}  # rank -> node that digests it (leader)
        self._http = http
        # A node's digests and instances go with its node credential (credentials.py), naming this node.
        self._headers = {"Authorization": f"Bearer {node_credential(cfg.token, self.node)}"} if cfg.token else {}
        self.link = LeaderLink(self.leader_url, self.clock)
        """This node's way to the leader: reachable, or since when not, and why."""
        self.leader_paused = False
        """The leader's last digest reply said the run is paused: no summaries flow, its ranks are up."""
        self._run_id: object = None  # the run (and its layout) this sidecar's reports describe
        self._layout: RankLayout | None = None
        self._ending_since: float | None = None  # when every rank here first said it ended (note_if_ended)
        self._switch_seen: float | None = None  # the engine's last_switch the hang clock was re-armed at
        self._idle_due = False
        """Due, judged, nothing decided (a crashed run, a pause): re-judged once a second, not at every ask."""
        self.metrics: HangMetrics | None = None
        self.link_metrics: LeaderLinkMetrics | None = None
        """Registered by install() (one set per sidecar)."""
        self.posts: dict[str, RawPost] = {}
        """path -> raw-body handler of /v1/activity and /v1/digest, set by install() (app.HotPosts serves them)."""
        self.forwarder = (
            crossnode.Forwarder(sidecar.transfer, self.leader_url, self.node, self._headers)
            if self.leader_url
            else None
        )
        self.forward_soon = asyncio.Event()
        """Set at a node when a rank reports first or ends: the leader hears of it now, not at the next tick
        (a rank that crashed in the run's first second was otherwise never reported when its peers' echoes
        reached the leader)."""

    # -- requests (event loop) --------------------------------------------------------------
    def activity(self, post: ActivityPost, client: Connection | None = None, identity: Identity | None = None) -> dict:
        """One rank's report; `client` (host, port) is the connection it came on, which proves its pid;
        `identity` who the credential speaks for (only its own rank of its own run)."""
        report = post.activity
        run_id = report.run_id or ""
        if identity is not None and identity.speaker != Speaker.OPERATOR:
            if identity.speaker != Speaker.RANK or identity.rank != report.rank or identity.run_id != run_id:
                raise Forbidden(
                    f"activity: rank {report.rank} of run {run_id[:64]!r}, but this credential speaks for "
                    f"{identity.describe()} only"
                )
        layout = layout_of((report.tp, report.pp, report.dp), report.order, "activity [tp, pp, dp]")
        a = in_layout(report.row(), layout, "activity")
        self._check_layout(run_id, layout, "activity [tp, pp, dp]")
        check_times(a, "activity", self.clock() + CLOCK_SKEW_SECONDS)
        self._check_run(run_id, "activity.run_id")
        self.pace.check(run_id, a.step, "activity", a.rank)
        new_run = self.book.run_id is not None and run_id != self.book.run_id
        before = None if new_run else self.book.latest.get(a.rank)  # a new run's book starts empty
        self.book.add(a, layout, run_id)
        if self.forwarder is not None and (before is None or before[0].state != a.state):
            self.forward_soon.set()
        self.pace.note(run_id, a.step, a.rank, a.step_seconds)
        if self._proven.get(a.rank) != (a.pid, True):  # proven once per rank and pid
            self._proven[a.rank] = (a.pid, owns_connection(a.pid, client))
        if new_run:  # the book started over for another run (NodeBook.add): so does the hang clock
            self.monitor.begin_run()
        self._run_id, self._layout = run_id, layout
        self.monitor.run_id = run_id
        if a.state != RankState.RUNNING:
            self.note_if_ended()
        if a.rank == 0:
            self.saw_rank0()
        if self.is_leader:
            self.monitor.observe(a, layout, self.clock())
        reply: dict = {"ok": True, "abort": HANG_EXIT_CODE} if self.abort else {"ok": True}
        if a.state == RankState.RUNNING and (wanted := self.evidence.request(run_id)) is not None:
            reply["evidence"] = wanted
        return reply

    def digest(self, digest: NodeDigest, client: Connection | None = None, identity: Identity | None = None) -> dict:
        """A node's digest (`client` is not used: its rows' pids are proven, and signalled, at that node); a
        node credential speaks for its own node's name only."""
        if identity is not None and identity.speaker != Speaker.OPERATOR:
            if identity.speaker != Speaker.NODE or identity.node != digest.node:
                raise Forbidden(
                    f"digest.node {digest.node[:64]!r}, but this credential speaks for {identity.describe()} only"
                )
        most = self.sidecar.config.max_ranks
        if len(digest.rows) > most:  # a node sidecar serves at most --max-ranks ranks: nothing larger is read
            raise BadActivity(
                f"digest.rows: {len(digest.rows)} rows, more than a node sidecar serves (--max-ranks {most})"
            )
        self._check_layout(
            digest.run_id or "", layout_of(digest.layout, digest.order, "digest.layout"), "digest.layout"
        )
        self._check_run(digest.run_id or "", "digest.run_id")
        seen_run = self.view.run_id
        node, rows, held = self.view.ingest(digest)
        if seen_run is not None and self.view.run_id != seen_run and self.view.run_id != self.book.run_id:
            self.monitor.begin_run()  # the leader's picture started over for another run (LeaderView.ingest)
        self._run_id, self._layout = self.view.run_id, self.view.layout
        self.monitor.run_id = self.view.run_id or ""
        now, layout = self.clock(), self.view.layout
        assert layout is not None  # ingest fixed it
        for a in rows:
            self._node_of[a.rank] = node
            if a.rank == 0:
                self.saw_rank0()  # rank 0 lives on a node that forwards to us: we lead (without --leader-url)
            self.monitor.observe(a, layout, now, age=digest.time - a.time)  # the node and its ranks: one clock
        reply: dict = {"ok": True}
        if held:
            reply["refused"] = self.sidecar.refusals.held("/v1/digest", held, f"{len(digest.rows)} rows")
        if self.run_paused():
            reply["paused"] = True  # a deliberate pause: the node keeps its ranks up
        pids = self._signals.pop(node, None)
        if pids:
            reply["signal"] = pids
        if self.abort:
            reply["abort"] = HANG_EXIT_CODE
        if (wanted := self.evidence.request(digest.run_id or "")) is not None:
            reply["evidence"] = wanted
        return reply

    def saw_rank0(self) -> None:
        """Rank 0 reports here (or through a node): the leader, unless started as a node (--leader-url); a
        (re)started leader then waits one grace period before it judges anything."""
        if self.leader_url is not None:
            return
        self.is_leader = True
        if self.quiet_until is None:
            self.quiet_until = self.clock() + (self.view.grace_seconds if self.restarted else 0.0)

    def quiet(self) -> bool:
        """A restarted leader, within the grace period after it first heard from rank 0 since it started."""
        return self.quiet_until is None or self.clock() < self.quiet_until

    def run_paused(self) -> bool:
        """The run is paused on purpose: the engine applied a pause, or rank 0 said lately that its ranks beat
        heartbeats (they do only while paused): never a hang, never ranks down."""
        beat = self.heartbeat_at
        return self.sidecar.engine.paused or (beat is not None and self.clock() - beat <= HEARTBEAT_SECONDS)

    def live_run(self) -> str | None:
        """The run live here, if any: reported lately (--rank-grace-seconds) by its summaries, its ranks'
        activity or its nodes' digests, and not every rank ended. Another run is refused meanwhile."""
        store = self.sidecar.store
        if store.live_for() is not None:
            return store.run_id
        grace, now = store.grace_seconds, self.clock()
        if self.book.run_id is not None and any(
            now - seen <= grace and a.state == RankState.RUNNING for a, seen in self.book.latest.values()
        ):
            return self.book.run_id
        view = self.view
        if view.run_id is not None and view.running and now - view.last_heard <= grace:
            return view.run_id
        return None

    def _check_run(self, run_id: str, where: str) -> None:
        live = self.live_run()
        if live is not None and run_id != live:
            raise Conflict(
                f"{where}: run {run_id[:64]!r} refused: run {live[:64]!r} is live here; another run may take "
                f"over once its ranks have ended or it has been silent for {self.sidecar.store.grace_seconds:g} s"
            )

    def _check_layout(self, run_id, layout, where: str) -> None:
        """A run's layout is the one it was first seen with, by this sidecar's ranks or any node's
        digest (kept once a report of it is accepted)."""
        if run_id == self._run_id:
            same_layout(self._layout, layout, where)

    def status(self, rows: dict) -> dict:
        """GET /v1/hang's answer; `rows`: every rank's row (rows_between_posts())."""
        m = self.monitor
        counts = m.state_counts(rows)
        return {
            "leader": self.is_leader,
            "node": self.node,
            "leader_url": self.leader_url,
            "leader_link": self.link.status(self.is_leader),
            "hang": m.hang,
            "rank_states": counts,
            "bound_seconds": m.progress.bound(),
            "stalled_seconds": m.progress.stalled_for(self.clock()),
            "checked_stall_seconds": m.checked_stall,
            "last_step": m.progress.step,
            "busy": m.busy,
            "findings": m.findings[-5:],
            "evidence": self.evidence.status()[-5:],
        }

    # -- the loop ---------------------------------------------------------------------------
    def rows(self) -> dict:
        rows = self.view.rows()
        rows.update(self.book.rows())
        return rows

    async def rows_between_posts(self) -> dict:
        """rows(), taken SURVEY_SLICE ranks at a time: the posts that arrive meanwhile are answered between."""
        rows: dict = {}
        for _ in self.view.fill_rows(rows, SURVEY_SLICE):
            await asyncio.sleep(SURVEY_PAUSE_SECONDS)
        rows.update(self.book.rows())
        return rows

    async def tick(self) -> list[dict]:
        """Once a second: this node's ranks' waits for a CPU, liveness, cross-node expiry, forwarding (not the
        leader) or a judgement (the leader)."""
        await asyncio.to_thread(self.book.cpu_waits.sample)  # /proc reads, off the loop: ~0.1 ms a rank
        if not self.is_leader and self.sidecar.store.ranks.get(0) is not None:
            self.saw_rank0()
        if not (self.is_leader and self.quiet()):  # a (re)started leader waits one grace period
            self._feed_liveness()
            await asyncio.sleep(SURVEY_PAUSE_SECONDS)  # the posts meanwhile first: the leader's judgement follows
        self.sidecar.transfer.tick()  # cross-node instances expire by time, also once the run stopped
        if self.is_leader and not self.sidecar.transfer.leading:
            self.sidecar.transfer.lead()  # match what the nodes forward (it may have seen rank 0's activity first)
        if not self.is_leader:
            if self.book.layout is not None:
                self.link.check_orphan(sorted(self.book.latest), self.book.layout.world)
            await self._forward()
            return []
        records = self.monitor.check_nodes(self.view.missing_nodes(), self.view.ranks_of)
        records += await self.judge(full=True)
        await self.act()
        return records

    async def judge(self, full: bool = False) -> list[dict]:
        """The leader's hang and crash judgement, every JUDGE_EVERY_SECONDS (full: the once-a-second tick).
        Nothing within the grace period after a (re)start (quiet()); a paused run is never a hang. Its passes
        over every rank are taken in slices, and the posts that arrive meanwhile are answered between them."""
        self._after_fault()
        if not self.is_leader or self.quiet():
            return []
        local = self.book.rows()  # this node's ranks: a handful, pids checked
        gone = bool(self.view.gone - self.monitor.gone_reported) or any(
            a.state in ENDED and r not in self.monitor.gone_reported for r, a in local.items()
        )
        paused = self.run_paused()
        switched = self.sidecar.engine.last_switch
        if switched is not None and switched != self._switch_seen:  # a rollback or resume: the stall restarts
            self._switch_seen = switched
            self.monitor.progress.rearm(switched)
        if not self.monitor.due(paused, gone):
            self._idle_due = False
            return []
        if self._idle_due and not full and not gone:
            return []  # a crashed run or a pause: the whole picture once a second is enough
        run = self.monitor.run_id
        rows = await self.rows_between_posts()
        survey = self.monitor.survey(rows)
        await asyncio.sleep(SURVEY_PAUSE_SECONDS)
        for _ in survey.slices():
            await asyncio.sleep(SURVEY_PAUSE_SECONDS)
        layout = self.monitor.layout
        if layout is not None and self.monitor.stalled_past_bound(self.monitor.progress.stalled_for(self.clock())):
            survey.culprit(layout, survey.fresh_after)  # the search's per-wait part: a step of its own
            await asyncio.sleep(SURVEY_PAUSE_SECONDS)
        if self.monitor.run_id != run or self.sidecar.engine.last_switch != switched:
            return []  # another run, or a rollback, since the picture was taken: judged at the next ask
        cov = survey.coverage(layout.world, self.view.missing_nodes()) if layout is not None else None
        records = self.monitor.check(
            rows,
            paused=paused,
            coverage=cov,
            heard_since=self.view.heard_since,
            survey=survey,
        )
        self._idle_due = not records and not self.monitor.awaiting_fresh and self.monitor.held_until is None
        for record in records:
            bundle = bundle_of(record)
            if bundle and isinstance(record.get("id"), int):
                self.evidence.ask(self.monitor.run_id, record["id"], bundle, survey.running)
        self._to_act += [r for r in records if r.get("rule") == BuiltinRule.HANG]
        return records

    async def act(self) -> None:
        """Act on the hang records judged (stacks, abort) once they are committed; a state dir that cannot be
        written undoes them instead (recorded nothing: nothing is done, and they are judged again)."""
        hang, gone = self.monitor.hang, self.monitor.gone_reported
        if not self._to_act and hang is self._committed[0] and len(gone) == len(self._committed[1]):
            return
        epoch = self.sidecar.engine.epoch
        try:
            await self.sidecar.persist(epoch)
        except StorageFault:
            self._to_act = []
            self._after_fault()
            return
        self._committed = (self.monitor.hang, frozenset(self.monitor.gone_reported), self.monitor.cause)
        acts, self._to_act = self._to_act, []
        for record in acts:
            self._act_on_hang(record)

    def _after_fault(self) -> None:
        """A failed write put back the engine's state: the findings made since are undone, so the monitor
        forgets them too (judged again, and recorded, once the state dir takes writes)."""
        epoch = self.sidecar.engine.epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self.monitor.hang, gone, self.monitor.cause = self._committed
            self.monitor.gone_reported = set(gone)
            self._to_act = []

    def _signal_own(self, pid) -> None:
        """SIGUSR1 a pid only when it is a running rank of this run whose own process reported that pid over
        its connection to this sidecar (pid_owner): never a pid a report or the leader merely names."""
        own = any(
            a.pid == pid and a.state == RankState.RUNNING and self._proven.get(rank) == (pid, True)
            for rank, a in self.book.rows().items()
        )
        if own and isinstance(pid, int) and pid > 1:
            _signal(pid)
        else:
            log.warning("hang: not signalling pid %r: no running rank of this run proved it its own here", pid)

    def note_if_ended(self) -> None:
        """The run has ended here when every rank that reports here finished, crashed or is gone: then
        (and not before, while it posts) another run id may take over this sidecar."""
        store = self.sidecar.store
        if store.run_id is None or store.ended or self.book.run_id != store.run_id:
            return
        rows = self.book.rows()
        if not (
            rows
            and store.ranks.keys() <= rows.keys()
            and all(a.state == RankState.DONE or a.state in ENDED for a in rows.values())
        ):
            self._ending_since = None
            return
        # A rank says done before its shipper flushes its last summaries (the collector closes the activity
        # reporter first): the run's end waits for them, or FINAL_SUMMARIES_SECONDS if they were lost.
        now = self.clock()
        if self._ending_since is None:
            self._ending_since = now
        last = {r: rec.summary.step for r, rec in store.ranks.items()}
        behind = any(a.state == RankState.DONE and a.step > last.get(r, -1) for r, a in rows.items())
        if not behind or now - self._ending_since >= FINAL_SUMMARIES_SECONDS:
            store.ended = True

    def _feed_liveness(self) -> None:
        """rank_up for the rank-missing rule and parwatch_rank_up, now (see _liveness())."""
        store = self.sidecar.store
        if not store.ranks:
            return
        self.note_if_ended()
        if self.leader_paused:  # the run is paused on purpose (the leader says): no summaries, ranks up
            store.touch_all()
        up, series = self._liveness()
        store.publish_liveness(store.run_id, up)
        self.sidecar._count(self.sidecar.engine.observe_now("rank_up", series))

    def _liveness(self) -> tuple[dict[int, bool], dict[str, float]]:
        """rank -> up, for this run's ranks this sidecar knows: the leader every rank of every digest, a node
        its own. Activity first: running (computing, waiting on a peer, paused) is up; a process that ended,
        a silent reporter, a node gone quiet is down; a rank without activity, or done, goes by its summaries
        (within --rank-grace-seconds). Also the same as the rank_up observation's series. At the leader the digests' part
        (every rank of the run) is kept as they arrive: here it is copied, not rebuilt rank by rank."""
        store = self.sidecar.store
        summaries = store.summary_liveness()  # this sidecar's own ranks: a handful
        digests: dict[int, bool] = {}
        series: dict[str, float] = {}
        if self.is_leader and self.view.run_id == store.run_id:
            digests, series = self.view.liveness(), dict(self.view.up_series)
        own = (  # this node's own rows (checked pids) win over a digest's
            {
                r: a.state == RankState.RUNNING
                for r, a in self.book.rows().items()
                if a.state != RankState.DONE and not _replaced(a, store.ranks.get(r))
            }
            if self.book.run_id == store.run_id
            else {}
        )
        for rank, up in [*((r, u) for r, u in summaries.items() if r not in digests), *own.items()]:
            series[rank_key(rank)] = 1.0 if up else 0.0
        return {**summaries, **digests, **own}, series

    def _act_on_hang(self, record: dict) -> None:
        evidence = finding_evidence(record)
        culprit = evidence.culprit if isinstance(evidence, HangEvidence) else None
        if self.settings.dump_stacks and culprit and culprit.pid:
            if culprit.host == self.hostname:
                self._signal_own(culprit.pid)
            else:
                node = self._node_of.get(culprit.rank)
                if node:
                    self._signals.setdefault(node, []).append(culprit.pid)
        if record.get("action") == RuleAction.REQUEUE:
            self.sidecar.requeue.take([record])  # the whole job restarts: no rank needs to be told to exit
        elif self.settings.abort:
            log.error(
                "hang: aborting the run (ranks exit with %d) so it restarts from its last checkpoint", HANG_EXIT_CODE
            )
            self.abort = True

    async def _forward(self) -> None:
        if not self.leader_url or self.forwarder is None:
            return
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=0.5), trust_env=False)
        body = self.book.digest(self.node)
        if body is None:
            await self.forwarder.post(self._http)  # summaries may flow before any activity report
            return
        try:
            response = await self._http.post(
                self.leader_url + "/v1/digest",
                content=encode(body),
                headers={**self._headers, "Content-Type": "application/json"},
            )
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            reply = response.json()
        except Exception as exc:
            self.link.failed(f"{type(exc).__name__}: {exc}"[:300])
        else:
            self.link.ok()
            for pid in reply.get("signal") or ():
                self._signal_own(pid)
            if reply.get("abort"):
                self.abort = True
            self.leader_paused = reply.get("paused") is True
            wanted = reply.get("evidence")
            if isinstance(wanted, dict) and isinstance(wanted.get("decision"), int):
                self.evidence.ask(self.book.run_id, wanted["decision"])  # this node's ranks are asked in turn
        await self.forwarder.post(self._http)

    async def take_evidence(self, ev: RankEvidence, identity: Identity | None = None) -> dict:
        """A rank's evidence (from one of this node's ranks, or forwarded by a node): the leader keeps it
        beside its decision; a node passes it on to the leader. EvidenceRefused says why not; Forbidden when
        the credential speaks for another rank or run, or a node forwards a rank its digests do not carry."""
        layout = self._layout
        ev = replace_fields(ev, run_id=ev.run_id or "")
        if identity is not None:
            self._check_speaker(ev, identity)
        self.evidence.check(ev, layout.world if layout is not None else None)
        if self.is_leader:
            path = await asyncio.to_thread(self.evidence.store, ev)
            return {"ok": True, "stored": str(path.relative_to(self.evidence.root))}
        if not self.leader_url:
            raise EvidenceRefused("this sidecar is not the leader and has no --leader-url to pass evidence on to")
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=0.5), trust_env=False)
        self.evidence.note(ev)
        try:
            response = await self._http.post(
                self.leader_url + "/v1/evidence",
                content=encode(EvidencePost(1, ev)),
                headers={**self._headers, "Content-Type": "application/json"},
            )
        except Exception as exc:
            raise EvidenceRefused(f"the leader is unreachable ({type(exc).__name__})", 503) from None
        if response.status_code >= 400:
            raise EvidenceRefused(f"the leader refused it: {response.text[:200]}", response.status_code)
        return {"ok": True, "forwarded": True}

    def _check_speaker(self, ev: RankEvidence, identity: Identity) -> None:
        """Whose evidence a credential may post, against what this sidecar knows: a rank's credential only its
        own rank's, of its own run, and only a rank that reports its activity here; a node's credential only
        a rank its latest digest carries. The operator's token any rank's."""
        if identity.speaker == Speaker.RANK:
            for field, theirs, mine in (("rank", ev.rank, identity.rank), ("run_id", ev.run_id, identity.run_id)):
                if theirs != mine:
                    raise Forbidden(
                        f"evidence.{field}: rank {ev.rank} of run {(ev.run_id or '')[:64]!r}, but this credential speaks "
                        f"for {identity.describe()} only"
                    )
            if ev.rank not in self.book.latest:
                raise EvidenceRefused(
                    f"evidence.rank: rank {ev.rank} reports no activity to this sidecar (it hears ranks "
                    f"{sorted(self.book.latest)[:MAX_LISTED]}); a rank posts its evidence to its own node's sidecar"
                )
        elif identity.speaker == Speaker.NODE:
            carried = self.view.ranks_of(identity.node or "")
            if ev.rank not in carried:
                raise Forbidden(
                    f"evidence.rank: node {(identity.node or '')[:64]!r} forwards only the ranks its digests carry "
                    f"({carried[:MAX_LISTED]}), not rank {ev.rank}"
                )

    async def close(self) -> None:
        if self.book.exits is not None:
            self.book.exits.close()
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.aclose()


def _signal(pid: int) -> None:
    """Ask a rank for its Python stacks (the collector registered faulthandler on SIGUSR1)."""
    try:
        os.kill(pid, signal.SIGUSR1)
        log.warning("hang: sent SIGUSR1 to pid %d for a stack dump", pid)
    except OSError as err:
        log.warning("hang: cannot signal pid %d (%s)", pid, err)


def install(app: FastAPI, sidecar) -> ActivityHub:
    """Add /v1/activity, /v1/digest, /v1/instances and /v1/hang to the control app, the loop, and the metrics.

    `hub.posts` maps the two posts to their handlers of the raw body (app.HotPosts serves them)."""
    previous = getattr(sidecar, "activity", None)
    if previous is not None:  # a second app over the same sidecar (tests): one set of hang and link metrics
        sidecar.registry.unregister(previous.metrics)
        sidecar.registry.unregister(previous.link_metrics)
    hub = ActivityHub(sidecar)
    sidecar.activity = hub
    hub.metrics = HangMetrics(lambda: hub.monitor if hub.is_leader else None)
    sidecar.registry.register(hub.metrics)
    sidecar.rank_gauges["parwatch_rank_state"] = RankGauge(
        "parwatch_rank_state", lambda: hub.monitor.rank_states(hub.rows()) if hub.is_leader else None
    )
    hub.link_metrics = LeaderLinkMetrics(lambda: hub.link.status(hub.is_leader))
    sidecar.registry.register(hub.link_metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(_loop(hub))
        try:
            yield
        finally:
            task.cancel()
            await hub.close()

    token = sidecar.config.token
    auth = [Depends(bearer_dependency(Verifier(token) if token else None))]
    router = APIRouter(lifespan=lifespan)

    hub.posts = {
        "/v1/activity": _typed_post(ActivityPost, "", hub.activity),
        "/v1/digest": _typed_post(NodeDigest, "digest", hub.digest),
    }
    handle_activity, handle_digest = hub.posts["/v1/activity"], hub.posts["/v1/digest"]

    @router.post(
        "/v1/activity",
        dependencies=auth,
        responses={401: {}, 403: {}, 409: {}, 422: {}},
        openapi_extra=documented(ActivityPost),
    )
    async def activity(request: Request):
        """One rank's live activity (parwatch.collector.activity); the reply may say abort."""
        raw = await request.body()
        status, payload = await handle_activity(raw, client=connection_of(request.scope), identity=identity_of(request))
        return JSONResponse(payload, status_code=status)

    @router.post(
        "/v1/digest",
        dependencies=auth,
        responses={401: {}, 403: {}, 409: {}, 422: {}},
        openapi_extra=documented(NodeDigest),
    )
    async def digest(request: Request):
        """A node sidecar's digest of its ranks (parwatch.wire.activity.NodeDigest)."""
        raw = await request.body()
        status, payload = await handle_digest(raw, client=None, identity=identity_of(request))
        return JSONResponse(payload, status_code=status)

    crossnode.add_route(router, sidecar, auth)  # POST /v1/instances

    @router.post(
        "/v1/evidence",
        dependencies=auth,
        responses={401: {}, 403: {}, 409: {}, 422: {}, 503: {}},
        openapi_extra=documented(EvidencePost),
    )
    async def evidence(request: Request):
        """A rank's evidence for a decision that asked for it (parwatch.sidecar.evidence)."""
        try:
            post = decode(await request.body(), EvidencePost, "")
            return JSONResponse(await hub.take_evidence(post.evidence, identity_of(request)))
        except Forbidden as err:
            return JSONResponse({"detail": str(err)}, status_code=403)
        except BadRecord as err:
            return JSONResponse({"detail": str(err)}, status_code=422)
        except EvidenceRefused as err:
            return JSONResponse({"detail": str(err)}, status_code=err.status)

    @router.get("/v1/hang", dependencies=auth)
    async def hang():
        return JSONResponse(jsonable(hub.status(await hub.rows_between_posts())))

    app.include_router(router)
    return hub


def _typed_post(record: type, root: str, handle: Callable[..., dict]) -> RawPost:
    """A raw-body handler: the body decoded as `record` (parwatch.wire.codec; a large one in a thread), then
    handled; 422 naming the field (as every other endpoint answers a body it cannot use), 403 for a
    credential of another rank or node, 409 for a report of another run while this one is live."""

    async def run(raw: bytes, **context):
        body: Any
        try:
            if len(raw) <= SMALL_POST:
                body = decode(raw, record, root)
            else:
                body = await asyncio.to_thread(decode, raw, record, root)
            return 200, handle(body, **context)
        except Forbidden as err:
            return 403, {"detail": str(err)}
        except Conflict as err:
            return 409, {"detail": str(err)}
        except BadRecord as err:
            return 422, {"detail": str(err)}

    return run


def _next_ask(hub: ActivityHub) -> float:
    """JUDGE_EVERY_SECONDS, or less when a stall reaches the decision line sooner (at the leader)."""
    until = hub.monitor.seconds_until_due() if hub.is_leader else None
    return JUDGE_EVERY_SECONDS if until is None else min(JUDGE_EVERY_SECONDS, until)


def _replaced(a: Activity, rec) -> bool:
    """Whether row `a` tells of a process that ended before its rank's current one (its summaries' record
    `rec`) started: a restart's first summaries come before its first activity report (a second), and the
    old process's "crashed" must not keep the new one down meanwhile."""
    return a.state in ENDED and rec is not None and rec.started is not None and a.time < rec.started


async def _woken_to_forward(hub: ActivityHub, seconds: float) -> bool:
    """Sleep `seconds`; True (early) when a node has a rank's first report or its end to forward."""
    if hub.forwarder is None:
        await asyncio.sleep(seconds)
        return False
    try:
        await asyncio.wait_for(hub.forward_soon.wait(), seconds)
    except TimeoutError:
        return False
    hub.forward_soon.clear()
    return True


async def _loop(hub: ActivityHub) -> None:
    """tick() once a second; judge() at the asks between (the leader's hang test, JUDGE_EVERY_SECONDS)."""
    loop = asyncio.get_running_loop()
    next_tick = loop.time() + TICK_SECONDS
    while True:
        woken = await _woken_to_forward(hub, _next_ask(hub))
        try:
            now = loop.time()
            if now >= next_tick - JUDGE_EVERY_SECONDS / 2:  # the half: sleep overshoot must not make it 1.25 s
                # Due whatever woke the loop (a rank changing state at every post must not starve it); it forwards.
                next_tick = max(next_tick + TICK_SECONDS, now + TICK_SECONDS / 2)
                await hub.tick()
            elif woken:
                await hub._forward()
            else:
                await hub.judge()
                await hub.act()
        except Exception:  # one bad tick must not end hang detection
            log.exception("activity tick failed")
