"""What the sidecar knows about its ranks: the latest summary and a short window per rank,
counters accumulated over the run, and whether each rank is still reporting.

The store starts empty on every sidecar start (counters then restart from zero, which
Prometheus' rate() handles); what must survive restarts lives in the guardrail engine.

One writer (the event loop) and readers that may be interleaved with it: a scrape hands
the loop back every few ms (exposition.encode_async), so ingests land between its samples.
Every value a reader needs is an immutable object that a write replaces in one assignment,
so a scrape never sees half an update (a histogram's buckets always agree with its count);
that also makes reading from another thread safe.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from parwatch.schema import COLLECTIVE_BUCKETS, STEP_BUCKETS
from parwatch.sidecar.models import GlobalView, StepSummary

log = logging.getLogger(__name__)


class WindowEntry(NamedTuple):
    step: int
    time: float
    step_seconds: float
    compute_seconds: float
    idle_seconds: float
    bubble_ratio: float


class CollectiveTotals(NamedTuple):
    """One (op, group)'s histogram and bytes, summed over the ranks this sidecar serves."""

    buckets: tuple = (0,) * len(COLLECTIVE_BUCKETS)
    """Cumulative (le) counts, one per COLLECTIVE_BUCKETS bound; +Inf is count."""
    count: int = 0
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


@dataclass
class RankRecord:
    summary: StepSummary
    """The newest summary (by its end time) from this rank."""
    seen: float
    """Sidecar clock when this rank last posted."""
    window: deque
    totals: RankTotals = RankTotals()
    tokens_from: int = 0
    """Count this rank's tokens from this step on (a lower rank taking over mid-step)."""


_NO_COLLECTIVES = CollectiveTotals()


class Store:
    def __init__(self, grace_seconds: float = 30.0, window: int = 32, clock: Callable[[], float] = time.time):
        self.grace_seconds = grace_seconds
        self.window = window
        self.clock = clock
        self._reset(run_id=None)

    def _reset(self, run_id: str | None) -> None:
        self.run_id = run_id
        self.ranks: dict[int, RankRecord] = {}
        self.collectives: dict[tuple[str, str], CollectiveTotals] = {}
        self.tokens_total = 0
        self.global_view: GlobalView | None = None
        self.global_time = float("-inf")
        self.checkpoints: tuple[int, ...] = ()
        self._token_rank: int | None = None  # the lowest rank seen: the one whose tokens count
        self._token_step = -1  # the step whose tokens were counted last

    # -- writing --------------------------------------------------------------------------
    def add(self, s: StepSummary) -> bool:
        """Store one summary; False when it repeats one already stored (a shipper's retry)."""
        if s.run_id != self.run_id:
            if self.run_id is not None:
                log.warning("run %s replaced by run %s: per-rank state starts again", self.run_id, s.run_id)
            self._reset(s.run_id)
        now = self.clock()
        rec = self.ranks.get(s.rank)
        if rec is None:
            rec = self.ranks[s.rank] = RankRecord(summary=s, seen=now, window=deque(maxlen=self.window))
            if self._token_rank is None or s.rank < self._token_rank:
                # A lower rank takes over counting tokens after the last step already counted.
                rec.tokens_from = self._token_step + 1
                self._token_rank = s.rank
        elif rec.summary.step == s.step and rec.summary.time == s.time:
            rec.seen = now
            return False
        elif s.time >= rec.summary.time:
            rec.summary = s
        rec.seen = now
        rec.window.append(
            WindowEntry(s.step, s.time, s.step_seconds, s.compute_seconds, s.idle_seconds, s.bubble_ratio)
        )
        self._accumulate(rec, s)
        return True

    def _accumulate(self, rec: RankRecord, s: StepSummary) -> None:
        t = rec.totals
        first = bisect.bisect_left(STEP_BUCKETS, s.step_seconds)  # le semantics: x <= bound
        rec.totals = RankTotals(
            tuple(n + 1 if i >= first else n for i, n in enumerate(t.step_buckets)),
            t.step_count + 1,
            t.step_sum + s.step_seconds,
            t.compute_total + s.compute_seconds,
            t.idle_total + max(s.idle_seconds, 0.0),  # rounding can make idle a hair negative
        )
        # Every rank reports the run's tokens for the step: count them from one rank only.
        if s.rank == self._token_rank and s.step >= rec.tokens_from:
            self.tokens_total += s.tokens
            self._token_step = s.step
            rec.tokens_from = 0  # from now on every step counts, replays after a rollback too
        for c in s.collectives:
            tot = self.collectives.get((c.op, c.group), _NO_COLLECTIVES)
            buckets = tuple(a + b for a, b in zip(tot.buckets, c.buckets)) if c.buckets else tot.buckets
            self.collectives[(c.op, c.group)] = CollectiveTotals(
                buckets, tot.count + c.count, tot.seconds + c.seconds, tot.bytes + c.bytes)
        if s.rank == 0:
            self.checkpoints = tuple(s.checkpoints)
            if s.global_ is not None and s.time >= self.global_time:  # a late post is not the newest view
                self.global_view = s.global_
                self.global_time = s.time

    def touch_all(self) -> None:
        """Every known rank of the run was alive just now (see Sidecar.ingest)."""
        now = self.clock()
        for rec in self.ranks.values():
            rec.seen = now

    # -- reading --------------------------------------------------------------------------
    def age(self, rec: RankRecord) -> float:
        return max(self.clock() - rec.seen, 0.0)

    def is_up(self, rec: RankRecord) -> bool:
        return self.age(rec) <= self.grace_seconds

    def liveness(self) -> dict[int, bool]:
        """Every rank ever seen this run -> up; down ranks stay listed (rank_up 0)."""
        return {rank: self.is_up(rec) for rank, rec in sorted(list(self.ranks.items()))}

    def visible(self) -> list[RankRecord]:
        """Ranks whose series are still exported: silent for no more than 2x the grace period."""
        limit = 2 * self.grace_seconds
        return [rec for _, rec in sorted(list(self.ranks.items())) if self.age(rec) <= limit]

    @property
    def last_step(self) -> int | None:
        return max((rec.summary.step for rec in list(self.ranks.values())), default=None)

    def run_summary(self) -> StepSummary | None:
        """The lowest rank's latest summary: the source of run metadata."""
        rec = self.ranks.get(self._token_rank) if self._token_rank is not None else None
        return rec.summary if rec else None

    def recent(self, rank: int) -> list[WindowEntry]:
        rec = self.ranks.get(rank)
        return list(rec.window) if rec else []
