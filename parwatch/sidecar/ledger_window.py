"""Goodput and ETTR over the last minute, for guardrail rules (metrics `goodput_ratio`, `ettr_ratio`).

The sidecar sums its ranks' newest ledger counters (parwatch.collector.ledger, a summary's
`time_seconds`) each time it builds an observation and keeps the sums over time; a ratio over the
window is the difference of two sums, read as parwatch.ledger_view reads any counters. A rank whose
counters went down restarted: its difference counts from zero, as Prometheus's `rate` does.
"""

from __future__ import annotations

from collections import deque

from parwatch import ledger_view

WINDOW_SECONDS = 60.0
"""The same span as the recording rules' default rate window (1m): the sidecar's judgement and the
rendered alert read the same minute."""


class LedgerWindow:
    def __init__(self, seconds: float = WINDOW_SECONDS, max_points: int = 4096) -> None:
        self.seconds = seconds
        self._points: deque[tuple[float, dict[int, dict[str, float]]]] = deque(maxlen=max_points)

    def add(self, time: float, ranks: dict[int, dict[str, float]]) -> None:
        """Each rank's newest counters at `time` (the ranks that report a ledger)."""
        if ranks:
            self._points.append((time, ranks))
        while len(self._points) > 2 and self._points[1][0] <= time - self.seconds:
            self._points.popleft()  # keep one point at or before the window's start

    def ratios(self) -> dict | None:
        """{"goodput_ratio", "ettr"} over the window (over what is kept while it is younger than the
        window); None before two points a moment apart."""
        if len(self._points) < 2:
            return None
        (_, old), (_, new) = self._points[0], self._points[-1]
        deltas = []
        for rank, counters in new.items():
            before = old.get(rank, {})
            deltas.append(
                {c: max(0.0, v - before.get(c, 0.0)) if v >= before.get(c, 0.0) else v for c, v in counters.items()}
            )
        total = ledger_view.totals(deltas)
        if total is None or total["rank_seconds"] <= 0:
            return None
        return {"goodput_ratio": total["goodput_ratio"], "ettr": total["ettr"]}
