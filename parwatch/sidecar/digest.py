"""Node digests: each node's sidecar keeps its ranks' live activity and forwards a compact digest of
it to the run's leader sidecar, so the leader sees every rank without every rank posting to it.

Who is the leader: the sidecar that receives rank 0's activity or summaries (it learns it from
them). The others learn the leader's URL from configuration: `parwatch sidecar --leader-url URL`
(Helm: the leader pod's stable DNS name through a headless Service). A sidecar without
--leader-url that is not the leader keeps its digests to itself (single-node runs need nothing).

Liveness is decided on the node, where it can be checked: a rank whose pid no longer exists on
this host is `gone` (a crash); one alive but silent for `silent_seconds` is `silent`; one that
said it finished is `done`. Activity keeps flowing from a hung rank (its reporter thread is
independent of the blocked training thread), so a hang reads as `running` with the same span open.

Digest body (POST /v1/digest), one per node per second:
  {"version": 1, "node": NAME, "run_id": ID, "time": T, "layout": [tp, pp, dp],
   "rows": [[...ACTIVITY_ROW fields in order...], ...]}
(a node of an older version sends rows without the last field, step_end: read as null.)
The reply may carry {"signal": [pid, ...]}: the leader asks this node to signal (SIGUSR1) its
culprit for a stack dump.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Callable

from parwatch.sidecar.hang import ACTIVITY_ROW, Activity, Layout
from parwatch.sidecar.models import MAX_TIME

DIGEST_VERSION = 1
_INT_FIELDS = ("rank", "step", "pid", "stage", "tp_rank", "dp_rank")


class BadActivity(ValueError):
    """An activity report or digest is malformed; the message names the field."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


def activity_from_report(report: dict) -> tuple[Activity, Layout, str]:
    """A rank's POSTed activity -> (Activity, Layout, run_id); BadActivity names what is wrong."""
    if not isinstance(report, dict):
        raise BadActivity("activity must be an object")
    try:
        values = {f: report.get(f) for f in ACTIVITY_ROW}
        for f in _INT_FIELDS:
            if values[f] is None:
                raise BadActivity(f"activity.{f} is required (an integer)")
            values[f] = int(values[f])
        values["state"] = str(values["state"] or "running")
        if values["state"] not in ("running", "done"):
            raise BadActivity(f"activity.state must be running or done, got {values['state']!r}")
        values["host"] = str(values["host"] or "")
        values["time"] = float(values["time"] or 0.0)
        values["step_end"] = _wall_time_or_none(values["step_end"])
        for f in ("since", "step_seconds"):
            values[f] = None if values[f] is None else float(values[f])
        for f in ("peer", "seq"):
            values[f] = None if values[f] is None else int(values[f])
        layout = Layout(int(report["tp"]), int(report["pp"]), int(report["dp"]))
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, BadActivity):
            raise
        raise BadActivity(f"activity: {err}; send the fields of parwatch.collector.activity.ACTIVITY_FIELDS") from None
    if min(layout.tp, layout.pp, layout.dp) < 1 or not 0 <= values["rank"] < layout.world:
        raise BadActivity(f"activity.rank={values['rank']} is outside the layout tp*pp*dp={layout.world}")
    return Activity(**values), layout, str(report.get("run_id") or "")


def _wall_time_or_none(x) -> float | None:
    """activity.step_end: null, or a unix time in [0, MAX_TIME] (the hang clock starts there)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= MAX_TIME:
        raise BadActivity(f"activity.step_end must be null or a unix time in seconds (0..{MAX_TIME:g}), "
                          f"got {x!r}; send the wall time the rank ended `step`")
    return float(x)


class NodeBook:
    """The latest activity of the ranks that report to this sidecar, and their liveness."""

    def __init__(self, clock: Callable[[], float], silent_seconds: float = 5.0, hostname: str | None = None,
                 alive: Callable[[int], bool] = pid_alive):
        self.clock = clock
        self.silent_seconds = silent_seconds
        self.hostname = hostname or socket.gethostname()
        self._alive = alive
        self.run_id: str | None = None
        self.layout: Layout | None = None
        self.latest: dict[int, tuple[Activity, float]] = {}
        """rank -> (activity, sidecar clock when it arrived)."""

    def add(self, a: Activity, layout: Layout, run_id: str) -> None:
        if run_id != self.run_id:
            self.latest = {}  # a new run: the old ranks are not this run's
            self.run_id = run_id
        self.layout = layout
        self.latest[a.rank] = (a, self.clock())

    def rows(self) -> dict[int, Activity]:
        """Every rank with its liveness judged now."""
        now = self.clock()
        out = {}
        for rank, (a, seen) in list(self.latest.items()):
            state = a.state
            if state == "running":
                local = a.host == self.hostname
                if local and not self._alive(a.pid):
                    state = "gone"
                elif now - seen > self.silent_seconds:
                    state = "silent" if local else "gone"  # another host's pid cannot be checked here
            out[rank] = a if state == a.state else a._replace(state=state)
        return out

    def digest(self, node: str) -> dict | None:
        if self.layout is None:
            return None
        layout = self.layout
        return {"version": DIGEST_VERSION, "node": node, "run_id": self.run_id, "time": self.clock(),
                "layout": [layout.tp, layout.pp, layout.dp], "rows": [list(a) for a in self.rows().values()]}


class LeaderView:
    """At the leader: the latest digest of every node, merged into one picture of the run."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.run_id: str | None = None
        self.layout: Layout | None = None
        self.nodes: dict[str, tuple[float, list]] = {}
        """node -> (leader clock at arrival, rows as sent)."""
        self.gone: set[int] = set()
        """Ranks the latest digests report gone: kept on ingest so the leader's once-a-second check
        need not look at every rank while none is."""

    def ingest(self, body: dict) -> tuple[str, list]:
        """Store one digest; (node, its rows as Activity). BadActivity names a malformed field."""
        if not isinstance(body, dict) or body.get("version") != DIGEST_VERSION:
            raise BadActivity(f"digest.version must be {DIGEST_VERSION}")
        node = body.get("node")
        if not isinstance(node, str) or not node:
            raise BadActivity("digest.node must be a non-empty string (the sending node's name)")
        try:
            tp, pp, dp = (int(x) for x in body["layout"])
            rows = [Activity(*r) for r in body["rows"]]  # step_end, the last field, may be absent (older node)
        except (KeyError, TypeError, ValueError) as err:
            raise BadActivity(f"digest.layout must be [tp, pp, dp] and digest.rows lists of the "
                              f"{len(ACTIVITY_ROW)} fields {', '.join(ACTIVITY_ROW)} ({err})") from None
        run_id = body.get("run_id")
        if run_id != self.run_id:
            self.nodes, self.gone = {}, set()
            self.run_id = run_id
        self.layout = Layout(tp, pp, dp)
        self.nodes[node] = (self.clock(), rows)
        gone = self.gone
        for a in rows:
            if a.state == "gone":
                gone.add(a.rank)
            elif a.rank in gone:
                gone.discard(a.rank)
        return node, rows

    def rows(self) -> dict[int, Activity]:
        out = {}
        for _, rows in list(self.nodes.values()):
            for a in rows:
                out[a.rank] = a
        return out
