"""Posts this sidecar refused, told: counted, logged, and in status.

A refused post is data nobody sees: at the leader, a node's digests with another token (its ranks
silently missing from every judgement); at a node, its own ranks' summaries and activity with a
wrong token ("0 reporting", every rule "ok"). Each refusal of a hot post (/v1/ingest, /v1/activity,
/v1/digest) is counted in parwatch_posts_refused_total{post, reason}, logged at most once per
LOG_EVERY_SECONDS for each post and reason (with how many since), and summarised for status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from parwatch.catalog import family

log = logging.getLogger("parwatch.sidecar")

REASONS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    429: "over_limit",
    503: "unavailable",
}
"""HTTP status -> the reason label; any other 4xx/5xx is "other"."""
POSTS = {"/v1/ingest": "ingest", "/v1/activity": "activity", "/v1/digest": "digest"}
"""Path -> the post label: ranks' summaries, ranks' activity, node sidecars' digests."""
WHO = {"ingest": "ranks' summaries", "activity": "ranks' activity", "digest": "node sidecars' digests"}
LOG_EVERY_SECONDS = 60.0
MAX_DETAIL = 300


class Refusals(Collector):
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.counts: dict[tuple[str, str], int] = {}
        self._last: dict[tuple[str, str], tuple[float, str]] = {}  # (post, reason) -> (time, detail)
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (post, reason) -> (when, count then)

    def note(self, path: str, status: int, detail) -> None:
        """One refused post (gate.RequestGate, for every POST answered 4xx/5xx)."""
        post = POSTS.get(path)
        if post is None:
            return
        key = (post, REASONS.get(status, "other"))
        self.counts[key] = self.counts.get(key, 0) + 1
        text = (
            str(detail or "").strip()[:MAX_DETAIL] or f"HTTP {status} with no reason given (a sidecar bug: report it)"
        )
        now = self.clock()
        self._last[key] = (now, text)
        when, before = self._logged.get(key, (None, 0))
        if when is None or now - when >= LOG_EVERY_SECONDS:
            log.warning(
                "refused %s (HTTP %d, %d since the last such line): %s",
                WHO[post],
                status,
                self.counts[key] - before,
                text,
            )
            self._logged[key] = (now, self.counts[key])

    def held(self, path: str, held: Mapping[int, str], of: str) -> list[dict]:
        """Records refused alone, the rest of their post taken (a step ahead of the run): counted and logged
        as one refusal of the post; the answer's `refused`, [{index, reason}]. `of`: what the post held."""
        self.note(path, 422, f"{len(held)} of {of}, the rest taken: {held[min(held)]}")
        return [{"index": i, "reason": why} for i, why in sorted(held.items())]

    def status(self) -> list[dict]:
        """[{post, reason, count, last_time, detail}], for /v1/status."""
        return [
            {
                "post": post,
                "reason": reason,
                "count": n,
                "last_time": self._last[(post, reason)][0],
                "detail": self._last[(post, reason)][1],
            }
            for (post, reason), n in sorted(self.counts.items())
        ]

    def collect(self):
        if not self.counts:
            return
        refused = family(CounterMetricFamily, "parwatch_posts_refused_total")
        for (post, reason), n in sorted(self.counts.items()):
            refused.add_metric([post, reason], float(n))
        yield refused
