"""What the sidecar knows about its ranks: the latest summary per rank, counters accumulated over
the run, and whether each rank is still reporting.

The store starts empty on every sidecar start (counters then restart from zero, which
Prometheus' rate() handles); what must survive restarts lives in the guardrail engine.

One writer (the event loop) and readers that may be interleaved with it. Every value a reader needs is an immutable object that a write replaces in one assignment,
so a scrape never sees half an update (a histogram's buckets always agree with its count);
that also makes reading from another thread safe.

Order and identity come from the trainer's own counters, never from the client's clock:
(timeline, step) orders a rank's summaries (timeline counts the rollbacks applied, so a
replayed step is newer than the abandoned one), and (run_id, rank, timeline, step) is
counted at most once, whatever order retries arrive in. A summary's `time` is only
reported, so a wrong clock cannot hide newer steps from the engine or freeze the view.

Bounded: one run at a time, its world (tp, pp, dp) fixed at first contact, at most
`max_ranks` ranks, collectives keyed by a closed list of ops and groups, and a bounded
set of counted keys per rank (admit() refuses the rest before anything is stored).
"""

from __future__ import annotations

import bisect
import logging
import operator
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from parwatch import goodput, ledger_view
from parwatch.catalog import STEP_BUCKETS
from parwatch.rank_layout import RankLayout
from parwatch.sidecar.claims import Prove, Refused, check_process
from parwatch.sidecar.config import DEFAULT_MAX_RANKS, DEFAULT_MAX_RUNS
from parwatch.sidecar.ledger_window import LedgerWindow
from parwatch.sidecar.pace import Pace, RunPace
from parwatch.vocabulary import TimeCategory
from parwatch.wire.bounds import MAX_ROLLBACKS_PER_SECOND, MAX_STEPS_PER_SECOND
from parwatch.wire.steps import COLLECTIVE_BUCKETS, GlobalView, StepSummary

log = logging.getLogger(__name__)

STEP_TIMES_KEPT = goodput.RECENT_STEPS + goodput.BASELINE_STEPS
"""Enough step times for ml-goodput-measurement's deviation gauge (its last 100 against the 1,000 before)."""


class CollectiveTotals(NamedTuple):
    """One (op, group)'s histogram and bytes, summed over the ranks this sidecar serves."""

    buckets: tuple = (0,) * len(COLLECTIVE_BUCKETS)
    """Cumulative (le) counts, one per COLLECTIVE_BUCKETS bound; +Inf is count."""
    count: int = 0  # type: ignore[assignment]  # shadows tuple.count, which mypy forbids; read by name elsewhere
    seconds: float = 0.0
    bytes: int = 0


class RankTotals(NamedTuple):
    """One rank's counters over the run."""

    step_buckets: tuple = (0,) * len(STEP_BUCKETS)
    """Cumulative (le) step-duration counts, one per STEP_BUCKETS bound; +Inf is step_count."""
    step_count: int = 0
    step_sum: float = 0.0
    compute_total: float = 0.0
    idle_total: float = 0.0


PRODUCTIVE_KEPT = 1024
"""Steps whose productive seconds a rank's record keeps: a restart that resumes from further back moves all of
the ended process's productive time to wasted."""

MAX_KEYS_PER_RANK = 128
"""Counted (timeline, step) keys remembered per rank; a summary older than all of them is taken
as already counted (shippers post in order, so only a retry comes that late; refusing it
never counts anything twice)."""


class Counted:
    """The (timeline, step) keys of one rank already counted: the newest few (insertion order),
    and a floor at or below which every key counts as seen."""

    __slots__ = ("keys", "floor")

    def __init__(self):
        self.keys: dict[tuple[int, int], None] = {}
        self.floor: tuple[int, int] | None = None

    def __contains__(self, key) -> bool:
        return key in self.keys or (self.floor is not None and key <= self.floor)

    def add(self, key) -> None:
        self.keys[key] = None
        if len(self.keys) > MAX_KEYS_PER_RANK:
            old = next(iter(self.keys))
            del self.keys[old]
            self.floor = old if self.floor is None else max(self.floor, old)


@dataclass
class RankRecord:
    summary: StepSummary
    """The newest summary by (timeline, step) from this rank."""
    seen: float
    """Sidecar clock when this rank last posted."""
    totals: RankTotals = RankTotals()
    tokens_from: tuple[int, int] = (0, 0)
    """Count this rank's tokens from this (timeline, step) on (a lower rank taking over mid-run)."""
    counted: Counted = field(default_factory=Counted)
    started: float | None = None
    """When this rank's current process started (unix seconds; None: its collector does not say)."""
    productive: deque = field(default_factory=lambda: deque(maxlen=PRODUCTIVE_KEPT))
    """(step, productive seconds so far) of the current process's summaries, oldest first."""
    carried: dict[str, float] = field(default_factory=dict)
    """The ledger of this rank's earlier processes of the run, their down time and discarded steps included."""
    pid: int | None = None
    """The current process's pid once proven by its own connection (claims.py): then only it speaks for the rank."""
    last_post: float = 0.0
    """Sidecar clock when the current process last posted a summary (a restart must start after it)."""
    base_timeline: int = 0
    """This rank's timeline when this sidecar first saw it: it moves past that only with rollbacks handed out."""
    first_step: int = 0
    """The first step the current process reported (its warm-up starts there)."""

    def time_seconds(self) -> dict[str, float] | None:
        """This rank's ledger counters over the run: its earlier processes' and the current one's."""
        current = self.summary.time_seconds
        if current is None and not self.carried:
            return None
        return ledger_view.added(self.carried, {c.value: v for c, v in (current or {}).items()})


_NO_COLLECTIVES = CollectiveTotals()
_STEP_INCREMENTS = [(0,) * i + (1,) * (len(STEP_BUCKETS) - i) for i in range(len(STEP_BUCKETS) + 1)]
"""A step of duration in bucket i adds one to every cumulative (le) bucket from i on."""


def _short(run_id: str) -> str:
    return repr(run_id[:64] + ("..." if len(run_id) > 64 else ""))


class Store:
    def __init__(
        self,
        grace_seconds: float = 30.0,
        clock: Callable[[], float] = time.time,
        max_ranks: int = DEFAULT_MAX_RANKS,
        max_runs: int = DEFAULT_MAX_RUNS,
    ):
        self.grace_seconds = grace_seconds
        self.clock = clock
        self.max_ranks = max_ranks
        self.max_runs = max_runs
        self.runs: dict[str, float] = {}
        """Run ids seen lately -> sidecar clock of their last post (bounds run-id churn)."""
        self.rollbacks: Callable[[str], int | None] = lambda run_id: None
        """run id -> rollbacks the engine handed out to it since it first saw it, or None where this sidecar's
        engine does not steer that run (a node sidecar): how far its timeline may move (set by the Sidecar)."""
        self._reset(run_id=None)

    def _reset(self, run_id: str | None) -> None:
        self.run_id = run_id
        self.world: RankLayout | None = None
        """The run's layout (tp, pp, dp and their order), fixed by its first summary."""
        self.ranks: dict[int, RankRecord] = {}
        self.collectives: dict[tuple[str, str], CollectiveTotals] = {}
        self.tokens_total = 0
        self.global_view: GlobalView | None = None
        self.checkpoints: tuple[int, ...] = ()
        self._checkpoints_key: tuple[int, int] = (-1, -1)
        self._token_rank: int | None = None  # the lowest rank seen: the one whose tokens count
        self._token_key = (-1, -1)  # the (timeline, step) whose tokens were counted last
        self.ended = False
        """Every rank of the run that reports here said it finished or crashed, or its process is gone."""
        self._published: dict[int, bool] | None = None  # publish_liveness(): the activity hub's view of the run
        self.ledger_window = LedgerWindow()
        """The ranks' ledger counters over the last minute: goodput and ETTR for the rules."""
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        """Rank 0's step periods in arrival order: ml-goodput-measurement's step times (parwatch.goodput)."""
        self.first_seen: float | None = None
        """Sidecar clock of the run's first summary here."""
        self.heard = 0.0
        """Sidecar clock when a rank of the run last posted here (the newest of the ranks' `seen`): the
        activity hub asks it on every post."""
        self._steps = RunPace(self.clock, MAX_STEPS_PER_SECOND)
        self._timelines = Pace(self.clock, MAX_ROLLBACKS_PER_SECOND, "timeline")

    def live_for(self) -> float | None:
        """Seconds since the live run last posted here; None when there is none (no run yet, it ended,
        or it has been silent past the grace period): only then may another run id take over."""
        if self.run_id is None or self.ended or not self.ranks:
            return None
        quiet = self.clock() - self.heard
        return quiet if quiet <= self.grace_seconds else None

    # -- admission ------------------------------------------------------------------------
    def admit(self, summaries, field: str = "summaries", prove: Prove | None = None) -> dict[int, str]:
        """Raise Refused (naming the field) unless every summary fits the run's world and the limits, and
        its claims what the sidecar knows (its clock, the other ranks, its processes: claims.py). `prove`:
        pid -> its start when it holds the post's connection.

        Checks the whole post before any of it is stored, so a refused post changes nothing. Returns the
        summaries held back, {index: why}: a step further ahead than the other ranks' reports allow is
        refused alone, the rest of its post taken (a real rank's backlog refused whole lost every step in
        it); a post whose every summary is so refused is refused (422)."""
        run_id, world = self.run_id, self.world
        now = self.clock()
        new_ranks: set[int] = set()
        tops: list[tuple[int, int]] = []  # this post's two highest (step, rank) of distinct ranks: they corroborate
        held: dict[int, str] = {}
        for i, s in enumerate(summaries):
            where = f"{field}.{i}"
            if s.run_id != run_id:
                if i > 0:
                    raise Refused(
                        422,
                        f"{where}.run_id: one post carries one run's summaries "
                        f"({s.run_id!r} after {run_id!r}); post each run separately",
                    )
                quiet = self.live_for()
                if quiet is not None:  # run identity is decided once per run: a stray post cannot end it
                    assert run_id is not None  # live_for() is None while no run is here
                    raise Refused(
                        409,
                        f"{where}.run_id: run {_short(s.run_id)} refused: run {_short(run_id)} is "
                        f"live here (it posted {quiet:.1f} s ago); another run may take over once "
                        f"its ranks have ended or it has been silent for {self.grace_seconds:g} s",
                    )
                self._admit_run(s.run_id, where)
                run_id, world, new_ranks = s.run_id, None, set()
            if run_id == self.run_id:
                beside = next((t for t in tops if t[1] != s.rank), None)
                why = self._steps.too_far(s.run_id, s.step, s.rank, beside)
                if why is not None:
                    held[i] = f"{where}.step{why}"
                    continue
                self._admit_progress(s, where)
                first = self.first_seen if self.first_seen is not None else now
                check_process(self.ranks.get(s.rank), s, where, now, first, prove)
            else:
                check_process(None, s, where, now, now, prove)
            _admit_instances(s, where)
            tops = _top_two(tops, s.step, s.rank)
            if world is None:
                world = s.layout
            elif s.layout != world:
                raise Refused(
                    409,
                    f"{where}: run {run_id!r} has {world} (fixed by its first summary), this summary "
                    f"says {s.layout}; a new layout needs a new run id",
                )
            if run_id == self.run_id and s.rank in self.ranks:
                continue
            new_ranks.add(s.rank)
            known = len(self.ranks) if run_id == self.run_id else 0
            if known + len(new_ranks) > self.max_ranks:
                raise Refused(
                    429,
                    f"{where}.rank: this sidecar already serves {known} ranks of run {run_id!r}; "
                    f"more than --max-ranks {self.max_ranks} are refused (one sidecar per node)",
                )
        if held and len(held) == len(summaries):
            raise Refused(422, next(iter(held.values())))
        return held

    def _admit_progress(self, s: StepSummary, where: str) -> None:
        """Timelines move only as a run can move them (steps: admit), with a rollback the engine handed out
        (where it steers the run; elsewhere at most one a second), and a global view never past its own step.
        A summary past that would otherwise stand as the newest and freeze what follows."""
        rollbacks = self.rollbacks(s.run_id)
        rec = self.ranks.get(s.rank)
        if rollbacks is not None and rec is not None and s.timeline > rec.base_timeline + rollbacks:
            raise Refused(
                422,
                f"{where}.timeline={s.timeline}: rank {s.rank} was at timeline {rec.base_timeline} when this "
                f"sidecar first saw it, and the run has been handed {rollbacks} rollback(s) since; a timeline "
                "moves only with a rollback",
            )
        why = self._timelines.too_far(s.run_id, s.timeline)
        if why is not None:
            raise Refused(422, f"{where}.timeline{why}")
        if s.global_ is not None and s.global_.step > s.step:
            raise Refused(
                422,
                f"{where}.global.step={s.global_.step} is after the summary's own step {s.step}: "
                "rank 0's view describes a step that has ended",
            )

    def _admit_run(self, run_id: str, where: str) -> None:
        now = self.clock()
        for old, seen in list(self.runs.items()):
            if now - seen > 2 * self.grace_seconds:
                del self.runs[old]
        if run_id not in self.runs and len(self.runs) >= self.max_runs:
            raise Refused(
                429,
                f"{where}.run_id: {len(self.runs)} run ids posted here within the last "
                f"{2 * self.grace_seconds:g} s; more than --max-runs {self.max_runs} are refused "
                f"(one sidecar watches one run)",
            )

    # -- writing --------------------------------------------------------------------------
    def add(self, s: StepSummary, pid: int | None = None) -> bool:
        """Store one summary; False when (run, rank, timeline, step) was already counted (a retry).
        `pid`: the posting process, proven by its connection (claims.py), or None.

        Call admit() first: add() trusts the world, the limits and the claims."""
        now = self.clock()
        if s.run_id != self.run_id:
            if self.run_id is not None:
                log.warning("run %r replaced by run %r: per-rank state starts again", self.run_id, s.run_id)
            self._reset(s.run_id)
        self.runs[s.run_id] = now
        if self.first_seen is None:
            self.first_seen = now
        if self.world is None:
            self.world = s.layout
        key = s.key
        rec = self.ranks.get(s.rank)
        if rec is None:
            rec = self.ranks[s.rank] = RankRecord(
                summary=_kept(s),
                seen=now,
                counted=Counted(),
                started=s.process_start_time,
                pid=pid,
                base_timeline=s.timeline,
                first_step=s.step,
            )
            if self._token_rank is None or s.rank < self._token_rank:
                # A lower rank takes over counting tokens after the last step already counted.
                rec.tokens_from = (self._token_key[0], self._token_key[1] + 1)
                self._token_rank = s.rank
        elif (process := _process_order(rec, s)) < 0:
            return False  # a late post of a process this rank has restarted since
        elif process > 0:
            self._restart(rec, s)
            rec.pid = pid
        elif key in rec.counted:
            rec.seen = self.heard = now
            return False
        elif key > rec.summary.key:
            rec.summary = _kept(s)
        if rec.pid is None:
            rec.pid = pid
        rec.counted.add(key)
        if s.time_seconds is not None:
            rec.productive.append((s.step, s.time_seconds.get(TimeCategory.PRODUCTIVE, 0.0)))
        rec.seen = rec.last_post = self.heard = now
        self._steps.note(s.run_id, s.step, s.rank, s.step_seconds, ended=s.time)
        self._timelines.note(s.run_id, s.timeline)
        self._accumulate(rec, s)
        return True

    def _restart(self, rec: RankRecord, s: StepSummary) -> None:
        """Rank s.rank's process restarted (a crash, then torchrun or the operator started it again): its
        ledger so far and the time it was down are carried; its steps count again from where it resumed."""
        old = rec.summary
        assert rec.started is not None and s.process_start_time is not None  # _process_order said so
        if old.time_seconds is not None:
            ended = ledger_view.Process(rec.started, {c.value: v for c, v in old.time_seconds.items()}, rec.productive)
            rec.carried = ledger_view.restarted(rec.carried, ended, s.process_start_time, s.step - 1)
        log.warning(
            "rank %d restarted: its process started %.1f s after the last one, which reported step %d; it resumes at step %d",
            s.rank,
            s.process_start_time - rec.started,
            old.step,
            s.step,
        )
        rec.started, rec.base_timeline, rec.first_step = s.process_start_time, s.timeline, s.step
        rec.productive = deque(maxlen=PRODUCTIVE_KEPT)
        rec.counted = Counted()
        rec.summary = _kept(s)
        self.ended = False
        if self._published is not None and s.rank in self._published:
            self._published[s.rank] = True  # it posts again: up now, not at the hub's next tick (a new dict each)
        if s.rank == 0:  # its checkpoint lists start again: the newest is what it sends now
            self._checkpoints_key = (-1, -1)

    def _accumulate(self, rec: RankRecord, s: StepSummary) -> None:
        t = rec.totals
        first = bisect.bisect_left(STEP_BUCKETS, s.step_seconds)  # le semantics: x <= bound
        rec.totals = RankTotals(
            tuple(map(operator.add, t.step_buckets, _STEP_INCREMENTS[first])),  # map(): no Python loop per post
            t.step_count + 1,
            t.step_sum + s.step_seconds,
            t.compute_total + s.compute_seconds,
            t.idle_total + max(s.idle_seconds, 0.0),  # rounding can make idle a hair negative
        )
        # Every rank reports the run's tokens for the step: count them from one rank only.
        if s.rank == self._token_rank and s.key >= rec.tokens_from:
            self.tokens_total += s.tokens
            self._token_key = max(self._token_key, s.key)
            rec.tokens_from = (0, 0)  # from now on every new key counts, replays after a rollback too
        for c in s.collectives:
            tot = self.collectives.get((c.op, c.group), _NO_COLLECTIVES)
            buckets = tuple(map(operator.add, tot.buckets, c.buckets)) if c.buckets else tot.buckets
            self.collectives[(c.op, c.group)] = CollectiveTotals(
                buckets, tot.count + c.count, tot.seconds + c.seconds, tot.bytes + c.bytes
            )
        if s.rank == 0:
            self.step_times.append(s.step_seconds)
            if s.key >= self._checkpoints_key:  # a late post does not bring back an older list
                self.checkpoints, self._checkpoints_key = tuple(s.checkpoints), s.key
            # Every view rank 0 sends once is judged, in the order it arrives (its shipper posts in order): a
            # view ordered "newest" by its own (timeline, step) let one forged ahead hide the real ones after.
            if s.global_ is not None:
                self.global_view = s.global_

    def touch_all(self) -> None:
        """Every known rank of the run was alive just now (see Sidecar.ingest)."""
        now = self.clock()
        for rec in self.ranks.values():
            rec.seen = now
        self.heard = now

    # -- reading --------------------------------------------------------------------------
    def age(self, rec: RankRecord) -> float:
        return max(self.clock() - rec.seen, 0.0)

    def is_up(self, rec: RankRecord) -> bool:
        return self.age(rec) <= self.grace_seconds

    # The two below run over every rank once a second or per scrape: one clock read, not one per rank
    # (age(rec) <= x is now - rec.seen <= x, since x >= 0).
    def liveness(self) -> dict[int, bool]:
        """rank -> up (rank_up): the activity hub's view of this run when it published one (every rank the
        leader knows of, judged by their activity first: parwatch.sidecar.activity_api), else summary_liveness."""
        published = self._published
        return published if published is not None else self.summary_liveness()

    def publish_liveness(self, run_id: str | None, up: dict[int, bool]) -> None:
        """The activity hub's liveness of run `run_id` (once a second); ignored for another run than this one."""
        if run_id == self.run_id:
            self._published = up

    def summary_liveness(self) -> dict[int, bool]:
        """Every rank ever seen this run -> up from its summaries (within the grace period); down ranks stay listed."""
        now, grace = self.clock(), self.grace_seconds
        return {rank: now - rec.seen <= grace for rank, rec in sorted(list(self.ranks.items()))}

    def visible(self) -> list[RankRecord]:
        """Ranks whose series are still exported: silent for no more than 2x the grace period."""
        now, limit = self.clock(), 2 * self.grace_seconds
        return [rec for _, rec in sorted(list(self.ranks.items())) if now - rec.seen <= limit]

    @property
    def last_step(self) -> int | None:
        newest = max((rec.summary.key for rec in list(self.ranks.values())), default=None)
        return None if newest is None else newest[1]  # the newest timeline's step, after a rollback too

    def ledgers(self) -> dict[int, dict[str, float]]:
        """rank -> its goodput ledger counters over the run (RankRecord.time_seconds), for ranks that send one."""
        out = {}
        for rank, rec in list(self.ranks.items()):
            ledger = rec.time_seconds()
            if ledger is not None:
                out[rank] = ledger
        return out

    def run_summary(self) -> StepSummary | None:
        """The lowest rank's latest summary: the source of run metadata."""
        rec = self.ranks.get(self._token_rank) if self._token_rank is not None else None
        return rec.summary if rec else None


def _top_two(tops: list[tuple[int, int]], step: int, rank: int) -> list[tuple[int, int]]:
    """The two highest (step, rank) of distinct ranks, with rank `rank` at `step` added."""
    mine = max([t for t in tops if t[1] == rank] + [(step, rank)])
    return sorted([t for t in tops if t[1] != rank] + [mine], reverse=True)[:2]


def _admit_instances(s: StepSummary, where: str) -> None:
    """A rank's instance records name groups of this run's world: a group of more members than the world, or a
    member outside it, is refused (the model alone allowed 64 groups of 100,000 members)."""
    if s.instances is None:
        return
    world = s.tp * s.pp * s.dp
    for group, members in s.instances.groups.items():
        if len(members) > world or any(m >= world for m in members):
            raise Refused(
                422,
                f"{where}.instances.groups.{group}: {len(members)} members up to "
                f"{max(members, default=0)}, outside this run's world of {world} ranks",
            )


def _process_order(rec: RankRecord, s: StepSummary) -> int:
    """1 when `s` comes from a later process of its rank than `rec` holds (a restart), -1 from an earlier
    one, 0 from the same (or when a collector does not say)."""
    new, current = s.process_start_time, rec.started
    if new is None or current is None or ledger_view.same_process(new, current):
        return 0
    return 1 if new > current else -1


def _kept(s: StepSummary) -> StepSummary:
    """The summary as the store keeps it: without its instance records, which the transfer tracker takes
    once (held whole, 20 ranks of 3.9 MB summaries kept 24 MB each)."""
    return s if s.instances is None else msgspec.structs.replace(s, instances=None)
