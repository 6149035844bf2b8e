"""A node sidecar's way to the run's leader: reachable, or not since when and why.

The leader judges every rule, hang and crash of the run; a node whose digests do not reach it has
ranks nobody judges, and says so (status, the log, parwatch_leader_unreachable_since_timestamp_seconds):
- its digests fail (the leader is down or unreachable) or are refused (another token: HTTP 401);
- it has no --leader-url, yet its ranks belong to a larger run whose rank 0 reports elsewhere
  (ORPHAN_GRACE_SECONDS after its first report: rank 0 of a one-node run reports within a second).
The leader itself says 0; a sidecar that has seen no run exports nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from parwatch.catalog import family
from parwatch.vocabulary import SidecarRole

log = logging.getLogger("parwatch.sidecar")

ORPHAN_GRACE_SECONDS = 5.0
"""A sidecar without --leader-url warns once its ranks have been part of a larger run this long."""


class LeaderLink:
    def __init__(self, url: str | None, clock: Callable[[], float]):
        self.url = url
        self.clock = clock
        self.since: float | None = None
        """When the leader stopped being reachable (the first failure of the current run of them); None: reachable."""
        self.error: str | None = None
        self._orphan_seen: float | None = None  # first time this sidecar's ranks were part of a larger run

    @property
    def reachable(self) -> bool:
        return self.since is None

    def ok(self) -> None:
        if self.since is not None:
            log.warning("leader %s reachable again (unreachable since %.3f: %s)", self.url, self.since, self.error)
        self.since, self.error = None, None

    def failed(self, error: str) -> None:
        if self.since is None:
            self.since = self.clock()
            log.error(
                "leader %s unreachable (%s): this node's ranks are judged by nobody until it is back; "
                "retrying every second",
                self.url,
                error,
            )
        self.error = error

    def check_orphan(self, ranks_here: list[int], world: int) -> None:
        """No --leader-url: warn (once) when this sidecar's ranks are part of a larger run that rank 0 reports
        elsewhere (rank 0 reporting here makes this sidecar the leader, and this is not asked)."""
        if self.url is not None:
            return
        if len(ranks_here) >= world:
            self._orphan_seen, self.since, self.error = None, None, None
            return
        now = self.clock()
        if self._orphan_seen is None:
            self._orphan_seen = now
        if self.since is None and now - self._orphan_seen >= ORPHAN_GRACE_SECONDS:
            shown = ranks_here[:16]
            self.error = (
                f"this sidecar receives ranks {shown}{' ...' if len(ranks_here) > 16 else ''} of a "
                f"{world}-rank run whose rank 0 reports elsewhere, and it has no --leader-url: the run's "
                "leader never sees these ranks (no hang, crash or liveness judgement covers them); "
                "restart it with --leader-url http://LEADER-SIDECAR:PORT"
            )
            self.since = self._orphan_seen
            log.error("%s", self.error)

    def status(self, leader: bool) -> dict | None:
        if leader:
            return {"role": SidecarRole.LEADER, "reachable": True, "unreachable_since": None, "error": None}
        if self.url is None and self.since is None:
            return None  # alone (a one-node run, or nothing seen yet): there is no leader to reach
        return {
            "role": SidecarRole.NODE,
            "url": self.url,
            "reachable": self.reachable,
            "unreachable_since": self.since,
            "error": self.error,
        }


class LeaderLinkMetrics(Collector):
    """parwatch_leader_unreachable_since_timestamp_seconds, fresh on every scrape."""

    def __init__(self, status_fn: Callable[[], dict | None]):
        self._status_fn = status_fn

    def collect(self):
        st = self._status_fn()
        if st is None:
            return
        gauge = family(GaugeMetricFamily, "parwatch_leader_unreachable_since_timestamp_seconds")
        gauge.add_metric([], float(st["unreachable_since"] or 0.0))
        yield gauge
