"""The goodput ledger as operators read it: totals over ranks, goodput, ETTR, one line of text.

Ranks report their ledgers as counters (parwatch.collector.ledger): every category only grows,
so `productive` is gross (it still holds what rollbacks later discarded) and `wasted` counts the
discarded part again. Here, as in the recording rules: wall time = the sum less wasted; net
productive = productive - wasted; goodput = net productive / wall; ETTR = the share of wall time
outside OUTSIDE_TRAINING (docs/goodput.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from parwatch.vocabulary import OUTSIDE_TRAINING, TimeCategory

_WASTED, _PRODUCTIVE, _DOWN = TimeCategory.WASTED.value, TimeCategory.PRODUCTIVE.value, TimeCategory.DOWN.value
Category = TypeVar("Category", str, TimeCategory)
"""A ledger's key: a category's name as read from JSON, or the member a rank's own ledger holds."""


SAME_PROCESS_SECONDS = 1.0
"""Process start times closer than this name one process (a collector attached again computes its start anew)."""


def same_process(started: float, other: float) -> bool:
    """Whether two start times reported for a rank name the same process (0.0: not reported)."""
    return not started or not other or abs(started - other) < SAME_PROCESS_SECONDS


def wall_of(counters: Mapping[str, float]) -> float:
    """The wall time a rank's counters cover: the categories less wasted (counted in productive too)."""
    return sum(float(v) for c, v in counters.items() if c != _WASTED)


def restarted(
    carried: Mapping[str, float],
    ended: Process,
    restarted_at: float,
    resumed_step: int,
) -> dict[str, float]:
    """A rank's counters over its earlier processes after one more restart: `carried` (the processes
    before it) plus the one that ended, plus down: from that process's last counted second to the new
    one's start (`restarted_at`, unix seconds). What the old process ran after its last report (the
    step a crash cut short) is down too: nothing of it counts. The new process resumed after
    `resumed_step` (the checkpoint it loaded; 0 without one): the productive time of the ended
    process's later steps was discarded, and is wasted."""
    out = added(carried, ended.counters)
    out[_DOWN] = out.get(_DOWN, 0.0) + max(0.0, restarted_at - (ended.started + wall_of(ended.counters)))
    out[_WASTED] = out.get(_WASTED, 0.0) + ended.discarded_after(resumed_step)
    return out


@dataclass
class Process:
    """One process of a rank: its start (unix seconds), its newest counters and its productive seconds
    at the steps it reported, oldest first (cumulative; a rollback's replays come later in the list)."""

    started: float
    counters: Mapping[str, float]
    productive: Sequence[tuple[int, float]] = ()

    def discarded_after(self, step: int) -> float:
        """The productive seconds of this process's steps after `step` on its last timeline (all of them
        when `step` precedes every step it reported, or is older than those it kept)."""
        if not self.productive:
            return 0.0
        last = self.productive[-1][1]
        kept = next((p for s, p in reversed(self.productive) if s <= step), 0.0)
        return max(0.0, last - kept)


def across_restarts(processes: Sequence[Process]) -> dict[str, float]:
    """One rank's counters over all its processes of a run."""
    ordered = sorted(processes, key=lambda p: p.started)
    carried: dict[str, float] = {}
    for ended, new in zip(ordered, ordered[1:]):
        first = new.productive[0][0] if new.productive else 1
        carried = restarted(carried, ended, new.started, first - 1)
    return added(carried, ordered[-1].counters) if ordered else carried


def added(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two sets of counters summed per category."""
    out = dict(a)
    for category, seconds in b.items():
        out[category] = out.get(category, 0.0) + float(seconds)
    return out


def totals(counters: Iterable[Mapping[Category, float]]) -> dict | None:
    """Sum the ranks' counters: {"rank_seconds", "seconds" (net partition per category), "goodput_ratio",
    "ettr"}; None when no rank reported a ledger."""
    summed = dict.fromkeys((c.value for c in TimeCategory), 0.0)
    seen = False
    for ledger in counters:
        seen = True
        for category, seconds in ledger.items():
            if category in summed:
                summed[category] += float(seconds)
    if not seen:
        return None
    summed[_PRODUCTIVE] = max(0.0, summed[_PRODUCTIVE] - summed[_WASTED])  # net: a partition again
    wall = sum(summed.values())
    outside = sum(summed[c.value] for c in OUTSIDE_TRAINING)
    return {
        "rank_seconds": wall,
        "seconds": summed,
        "goodput_ratio": summed[_PRODUCTIVE] / wall if wall > 0 else None,
        "ettr": max(0.0, 1.0 - outside / wall) if wall > 0 else None,
    }


def as_counters(partition: Mapping[Category, float]) -> dict[Category, float]:
    """A net partition (a ledger-rank<N>.json's time_seconds) in the counter form `totals` reads."""
    out = dict(partition)
    out[TimeCategory.PRODUCTIVE] = out.get(TimeCategory.PRODUCTIVE, 0.0) + out.get(TimeCategory.WASTED, 0.0)
    return out


def line(total: dict | None, top: int = 6) -> str:
    """`time: goodput 41.0%, ETTR 77.2% of 120.4 rank-seconds; productive 41.0%, bubble_wait 18.3%, ...`"""
    if not total or not total["rank_seconds"]:
        return "time: no ledger reported yet"
    wall = total["rank_seconds"]
    parts = sorted(((s / wall, c) for c, s in total["seconds"].items() if s > 0), reverse=True)[:top]
    shares = ", ".join(f"{c} {share:.1%}" for share, c in parts)
    return f"time: goodput {total['goodput_ratio']:.1%}, ETTR {total['ettr']:.1%} of {wall:.1f} rank-seconds; {shares}"
