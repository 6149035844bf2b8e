"""Node digests: each node's sidecar keeps its ranks' live activity and forwards a compact digest of
it to the run's leader sidecar, so the leader sees every rank without every rank posting to it.

Who is the leader: the sidecar that receives rank 0's activity or summaries (it learns it from
them). The others learn the leader's URL from configuration: `parwatch sidecar --leader-url URL`
(Helm: the leader pod's stable DNS name through a headless Service). A sidecar without
--leader-url that is not the leader keeps its digests to itself (single-node runs need nothing).

Liveness is decided on the node, where it can be checked: a rank whose pid no longer exists on
this host is `gone` (a crash); one alive but silent for `silent_seconds` is `silent`; one that
said it finished is `done`; one that said it ended by an exception is `crashed`, with the exception. Activity keeps flowing from a hung rank (its reporter thread is
independent of the blocked training thread), so a hang reads as `running` with the same span open.

Digest body (POST /v1/digest), one per node per second:
  {"version": 1, "node": NAME, "run_id": ID, "time": T, "layout": [tp, pp, dp],
   "rows": [[...ACTIVITY_ROW fields in order...], ...]}
(a node of an older version sends rows without the last fields, step_end and error: read as null.)
The reply may carry {"signal": [pid, ...]}: the leader asks this node to signal (SIGUSR1) its
culprit for a stack dump.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from typing import Literal, overload

from parwatch.schema import MAX_ERROR_CHARS, MAX_STEPS_PER_SECOND
from parwatch.sidecar.hang import ACTIVITY_ROW, ENDED, Activity, Layout
from parwatch.sidecar.models import MAX_TIME
from parwatch.sidecar.pace import Pace
from parwatch.vocabulary import RankState

DIGEST_VERSION = 1


class BadActivity(ValueError):
    """An activity report or digest is malformed; the message names the field."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


# Bounds on what a report may claim. Every loop the leader runs over a run's ranks is bounded by
# the layout, so the layout is bounded (MAX_WORLD, above the largest runs published) and fixed per
# run at first contact; every other number is bounded by what a real run can have.
MAX_WORLD = 1 << 17
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_STEP = (1 << 31) - 1
MAX_SEQ = 1 << 53
MAX_TEXT = 64  # kind, op, group
MAX_HOST = 253  # a DNS name
REPORT_STATES = (RankState.RUNNING, RankState.DONE, RankState.CRASHED)
DIGEST_STATES = (*REPORT_STATES, RankState.GONE, RankState.SILENT)


# Typed so that a required field reads as its type and an optional one as `type | None`.
@overload
def _int(values: dict, field: str, where: str, lo: int, hi: int, optional: Literal[False] = ...) -> int: ...
@overload
def _int(values: dict, field: str, where: str, lo: int, hi: int, optional: Literal[True]) -> int | None: ...
def _int(values: dict, field: str, where: str, lo: int, hi: int, optional: bool = False) -> int | None:
    x = values.get(field)
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise BadActivity(
            f"{where}.{field} must be {'null or ' if optional else ''}an integer in {lo}..{hi}, got {x!r}"
        )
    return x


@overload
def _float(
    values: dict, field: str, where: str, lo: float, hi: float, optional: Literal[True] = ...
) -> float | None: ...
@overload
def _float(values: dict, field: str, where: str, lo: float, hi: float, optional: Literal[False]) -> float: ...
def _float(values: dict, field: str, where: str, lo: float, hi: float, optional: bool = True) -> float | None:
    x = values.get(field)
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:  # NaN fails both
        raise BadActivity(
            f"{where}.{field} must be {'null or ' if optional else ''}a number in {lo:g}..{hi:g}, got {x!r}"
        )
    return float(x)


@overload
def _text(values: dict, field: str, where: str, limit: int, optional: Literal[True] = ...) -> str | None: ...
@overload
def _text(values: dict, field: str, where: str, limit: int, optional: Literal[False]) -> str: ...
def _text(values: dict, field: str, where: str, limit: int, optional: bool = True) -> str | None:
    x = values.get(field)
    if x is None and optional:
        return None
    if not isinstance(x, str) or len(x) > limit or not x.isprintable():
        raise BadActivity(
            f"{where}.{field} must be {'null or ' if optional else ''}a printable string of at most {limit} characters"
        )
    return x


def layout_from(value, where: str) -> Layout:
    """[tp, pp, dp] -> Layout, each >= 1 and tp*pp*dp <= MAX_WORLD; BadActivity names the field."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)
    ):
        raise BadActivity(f"{where} must be [tp, pp, dp], three integers >= 1, got {value!r}")
    layout = Layout(*value)
    if layout.world > MAX_WORLD:
        raise BadActivity(
            f"{where} {list(value)} is a world of {layout.world} ranks, over the {MAX_WORLD} a sidecar accepts"
        )
    return layout


def activity_row(values: dict, layout: Layout, where: str, states: tuple[str, ...]) -> Activity:
    """One rank's activity, every field checked against the run's layout and a real run's bounds."""
    world = layout.world
    rank = _int(values, "rank", where, 0, world - 1)
    stage = _int(values, "stage", where, 0, layout.pp - 1)
    tp_rank = _int(values, "tp_rank", where, 0, layout.tp - 1)
    dp_rank = _int(values, "dp_rank", where, 0, layout.dp - 1)
    expected = layout.rank_of(stage, tp_rank, dp_rank)
    if rank != expected:
        raise BadActivity(
            f"{where}: rank {rank} is not (stage {stage}, tp_rank {tp_rank}, dp_rank {dp_rank}) "
            f"of layout [{layout.tp}, {layout.pp}, {layout.dp}] (that is rank {expected})"
        )
    state = values.get("state")
    if state not in states:
        raise BadActivity(f"{where}.state must be one of {', '.join(states)}, got {state!r}")
    return Activity(
        rank=rank,
        state=state,
        kind=_text(values, "kind", where, MAX_TEXT),
        op=_text(values, "op", where, MAX_TEXT),
        group=_text(values, "group", where, MAX_TEXT),
        peer=_int(values, "peer", where, 0, world - 1, optional=True),
        seq=_int(values, "seq", where, 0, MAX_SEQ, optional=True),
        since=_float(values, "since", where, 0.0, MAX_TIME),
        step=_int(values, "step", where, -1, MAX_STEP),
        step_seconds=_float(values, "step_seconds", where, 0.0, 1e7),
        pid=_int(values, "pid", where, 0, MAX_PID),
        host=_text(values, "host", where, MAX_HOST, optional=False),
        stage=stage,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        time=_float(values, "time", where, 0.0, MAX_TIME, optional=False),
        step_end=_float(values, "step_end", where, 0.0, MAX_TIME),
        error=_error(values, where),
    )


def _error(values: dict, where: str) -> str | None:
    error = values.get("error")
    if error is None:
        return None
    if not isinstance(error, str):
        raise BadActivity(f"{where}.error must be null or a string (the exception a crashed rank ended with)")
    return "".join(c if c.isprintable() else " " for c in error[:MAX_ERROR_CHARS])


def activity_from_report(report) -> tuple[Activity, Layout, str]:
    """A rank's POSTed activity -> (Activity, Layout, run_id); BadActivity names what is wrong."""
    if not isinstance(report, dict):
        raise BadActivity("activity must be an object with the fields of parwatch.collector.activity")
    layout = layout_from([report.get("tp"), report.get("pp"), report.get("dp")], "activity [tp, pp, dp]")
    values = dict(report)
    values.setdefault("state", "running")
    values["host"] = values.get("host") or ""
    return activity_row(values, layout, "activity", REPORT_STATES), layout, _run_id(report.get("run_id"), "activity")


def _run_id(x, where: str) -> str:
    if x is None:
        return ""
    if not isinstance(x, str) or len(x) > 128 or not x.isprintable():
        raise BadActivity(f"{where}.run_id must be a printable string of at most 128 characters")
    return x


class LayoutChanged(BadActivity):
    """A report for a known run claims another layout than the one the run was first seen with."""


def same_layout(known: Layout | None, layout: Layout, where: str) -> None:
    if known is not None and known != layout:
        raise LayoutChanged(
            f"{where} [{layout.tp}, {layout.pp}, {layout.dp}] differs from this run's "
            f"[{known.tp}, {known.pp}, {known.dp}], fixed when it was first seen; a run's layout "
            "cannot change (a new layout is a new run id)"
        )


class StepPace(Pace):
    """A run's step pace (pace.Pace), refusing with BadActivity."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__(clock, MAX_STEPS_PER_SECOND, "step")

    def check(self, run_id: str, step: int, where: str) -> None:
        why = self.too_far(run_id, step)
        if why is not None:
            raise BadActivity(f"{where}.step{why}")


class NodeBook:
    """The latest activity of the ranks that report to this sidecar, and their liveness."""

    def __init__(
        self,
        clock: Callable[[], float],
        silent_seconds: float = 5.0,
        hostname: str | None = None,
        alive: Callable[[int], bool] = pid_alive,
    ):
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
            self.layout = None
        same_layout(self.layout, layout, "activity [tp, pp, dp]")
        self.layout = layout
        self.latest[a.rank] = (a, self.clock())

    def rows(self) -> dict[int, Activity]:
        """Every rank with its liveness judged now."""
        now = self.clock()
        out = {}
        for rank, (a, seen) in list(self.latest.items()):
            state = a.state
            if state == RankState.RUNNING:
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
        return {
            "version": DIGEST_VERSION,
            "node": node,
            "run_id": self.run_id,
            "time": self.clock(),
            "layout": [layout.tp, layout.pp, layout.dp],
            "rows": [list(a) for a in self.rows().values()],
        }


class LeaderView:
    """At the leader: the latest digest of every node, merged into one picture of the run. A node
    whose digests stopped for `grace_seconds` is missing: its ranks read `unknown`, never `running`."""

    def __init__(self, clock: Callable[[], float], grace_seconds: float = 5.0, pace: StepPace | None = None):
        self.clock = clock
        self.grace_seconds = grace_seconds
        self.pace = pace or StepPace(clock)
        self.run_id: str | None = None
        self.layout: Layout | None = None
        self.nodes: dict[str, tuple[float, list]] = {}
        """node -> (leader clock at arrival, rows as sent)."""
        self.owner: dict[int, str] = {}
        """rank -> the node that reports it: another node's row for it is refused while that node is heard."""
        self.gone: set[int] = set()
        """Ranks the latest digests report gone: kept on ingest so the leader's once-a-second check
        need not look at every rank while none is."""

    def ingest(self, body: dict) -> tuple[str, list]:
        """Store one digest; (node, its rows as Activity). BadActivity names a malformed field."""
        if not isinstance(body, dict) or body.get("version") != DIGEST_VERSION:
            raise BadActivity(f"digest.version must be {DIGEST_VERSION}")
        node = body.get("node")
        if not isinstance(node, str) or not node or len(node) > MAX_HOST + 6 or not node.isprintable():
            raise BadActivity(
                f"digest.node must be a non-empty printable string of at most {MAX_HOST + 6} "
                "characters (the sending node's name)"
            )
        layout = layout_from(body.get("layout"), "digest.layout")
        raw = body.get("rows")
        if not isinstance(raw, list) or len(raw) > layout.world:
            raise BadActivity(f"digest.rows must be a list of at most {layout.world} rows (the layout's world)")
        rows, seen = [], set()
        for i, r in enumerate(raw):
            # step_end and error, the last fields, may be absent (an older node)
            if not isinstance(r, list) or not len(ACTIVITY_ROW) - 2 <= len(r) <= len(ACTIVITY_ROW):
                raise BadActivity(
                    f"digest.rows[{i}] must be a list of the {len(ACTIVITY_ROW)} fields {', '.join(ACTIVITY_ROW)}"
                )
            a = activity_row(dict(zip(ACTIVITY_ROW, r)), layout, f"digest.rows[{i}]", DIGEST_STATES)
            if a.rank in seen:
                raise BadActivity(f"digest.rows[{i}]: rank {a.rank} appears twice")
            seen.add(a.rank)
            rows.append(a)
        run_id = _run_id(body.get("run_id"), "digest")
        for i, a in enumerate(rows):
            self.pace.check(run_id, a.step, f"digest.rows[{i}]")
        if run_id == self.run_id:
            same_layout(self.layout, layout, "digest.layout")
            self._check_owners(node, rows)
        else:
            self.nodes, self.gone, self.owner = {}, set(), {}
            self.run_id = run_id
            self.layout = None
        if node not in self.nodes and len(self.nodes) >= layout.world:
            raise BadActivity(
                f"digest.node {node!r}: this run already has {len(self.nodes)} nodes, as many as its ranks"
            )
        self.layout = layout
        self.nodes[node] = (self.clock(), rows)
        gone = self.gone
        for a in rows:
            self.owner[a.rank] = node
            self.pace.note(run_id, a.step)
            if a.state in ENDED:
                gone.add(a.rank)
            elif a.rank in gone:
                gone.discard(a.rank)
        return node, rows

    def _check_owners(self, node: str, rows: list) -> None:
        """A rank is reported by one node: a row from another (a forged `gone`, a misconfigured node) is
        refused while its own node is heard from; once that node is missing, another may take the rank over."""
        now = self.clock()
        for i, a in enumerate(rows):
            owner = self.owner.get(a.rank)
            if (
                owner is not None
                and owner != node
                and owner in self.nodes
                and now - self.nodes[owner][0] <= self.grace_seconds
            ):
                raise BadActivity(f"digest.rows[{i}]: rank {a.rank} is reported by node {owner!r}, not {node!r}")

    def rows(self) -> dict[int, Activity]:
        now, out = self.clock(), {}
        for seen, rows in list(self.nodes.values()):
            stale = now - seen > self.grace_seconds
            for a in rows:
                out[a.rank] = (
                    a._replace(state="unknown") if stale and a.state in (RankState.RUNNING, RankState.SILENT) else a
                )
        return out

    def missing_nodes(self) -> list[dict]:
        """Nodes whose digests stopped: [{"node", "since": their last digest's arrival}], oldest first."""
        now = self.clock()
        return sorted(
            (
                {"node": n, "since": round(seen, 3)}
                for n, (seen, _) in self.nodes.items()
                if now - seen > self.grace_seconds
            ),
            key=lambda m: m["since"],
        )
