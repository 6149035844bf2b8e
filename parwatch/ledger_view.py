"""The goodput ledger as operators read it: totals over ranks, goodput, ETTR, one line of text.

Ranks report their ledgers as counters (parwatch.collector.ledger): every category only grows,
so `productive` is gross (it still holds what rollbacks later discarded) and `wasted` counts the
discarded part again. Here, as in the recording rules: wall time = the sum less wasted; net
productive = productive - wasted; goodput = net productive / wall; ETTR = the share of wall time
outside OUTSIDE_TRAINING (docs/goodput.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from parwatch.vocabulary import OUTSIDE_TRAINING, TimeCategory

_WASTED, _PRODUCTIVE = TimeCategory.WASTED.value, TimeCategory.PRODUCTIVE.value


def totals(counters: Iterable[Mapping[str, float]]) -> dict | None:
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


def as_counters(partition: Mapping[str, float]) -> dict[str, float]:
    """A net partition (a ledger-rank<N>.json's time_seconds) in the counter form `totals` reads."""
    out = dict(partition)
    out[_PRODUCTIVE] = out.get(_PRODUCTIVE, 0.0) + out.get(_WASTED, 0.0)
    return out


def line(total: dict | None, top: int = 6) -> str:
    """`time: goodput 41.0%, ETTR 77.2% of 120.4 rank-seconds; productive 41.0%, bubble_wait 18.3%, ...`"""
    if not total or not total["rank_seconds"]:
        return "time: no ledger reported yet"
    wall = total["rank_seconds"]
    parts = sorted(((s / wall, c) for c, s in total["seconds"].items() if s > 0), reverse=True)[:top]
    shares = ", ".join(f"{c} {share:.1%}" for share, c in parts)
    return f"time: goodput {total['goodput_ratio']:.1%}, ETTR {total['ettr']:.1%} of {wall:.1f} rank-seconds; {shares}"
