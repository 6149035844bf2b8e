"""Hang detection at the run's leader sidecar: who stopped the run, from every rank's live activity.

A hang is no step boundary for max(step_factor x median step time, min_seconds) (1.4x and 2.75 s by
default). The culprit comes from the dependency picture of the ranks' open spans
(parwatch.collector.activity): a rank in a recv or a send waits for its peer (a send open as the rank's
current span has not been taken: gloo's, and NCCL's past its eager size, complete only as the peer
receives; DeepSpeed's DualPipeV commits its sends before its receives); a rank in collective number
k of group G waits for every member of G not in that collective (still computing, or in an
earlier one). Following those edges ends at ranks that wait for nobody: the one most ranks
(transitively) wait for is the culprit. A rank whose process ended is a crash (`rank-gone`), told
apart from a hang (alive, activity still arriving, the same span open).

Timing: the stall is timed from when the ranks ended the last step boundary (their wall clock,
carried as `step_end` in the activity, mapped onto the leader's clock and clamped by the report's
arrival: `Progress.boundary_time`), not from when the leader heard of it (up to ~2 s later). The
leader asks every JUDGE_EVERY_SECONDS, and right when the stall reaches the bound, whether it passed
the bound (two numbers); it decides at the bound, never before: a stall shorter than the bound is never
named (a false hang aborts a run under --hang-abort), and a hang is named a loop wake-up (milliseconds)
after its bound.

Pure analysis (`find_culprit`, `Progress`) is separate from the leader's state machine
(`HangMonitor`), which records decisions through the guardrail engine and keeps the states the
metrics export (`HangMetrics`: parwatch_hang_detected, parwatch_rank_state{rank}).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from parwatch.catalog import RANK_STATES, family
from parwatch.rank_layout import ROLES, Coords, RankLayout
from parwatch.vocabulary import BuiltinRule, GroupRole, HangKind, RankState, RuleAction, SpanKind
from parwatch.wire.activity import Activity, Busy
from parwatch.wire.findings import (
    Coverage,
    Culprit,
    Finding,
    HangEvidence,
    Missing,
    NodeMissing,
    PointsAt,
    RankGoneEvidence,
    SidecarLostEvidence,
    finding_evidence,
)

BUSY_STEP_FACTOR = 20.0
"""A rank busy in a declared long activity is stalled only past max(busy_seconds, this x median step)."""
LATE_REPORT_SECONDS = 2.0
"""A running rank whose newest activity sample is older than this at the leader is late (a rank reports once
a second; another node's sample is dated by its node's digest, one host's clock): its row may show it as it was
when it stopped (a process or a whole node stopped, a host hiccup), so no hang is named from that picture
until it speaks again (a moment later, if it only paused), goes silent (a frozen process: then it is named)
or its node goes missing (its ranks are then gone)."""
CLOCK_SKEW_SECONDS = 1.0
"""Ranks' wall clocks and the leader's may disagree by this much (NTP keeps them far closer)."""
MAX_REPORT_LATENCY_SECONDS = 2.0
"""Longest a rank's activity sample takes to reach the leader: it waits up to one digest tick (1 s)
at its node's sidecar, then an HTTP post; 1 s of margin. It bounds how far a rank's clock can move
a stall's start (Progress.boundary_time)."""
MAX_STARVED_SHARE = 0.75
"""At most this share of a stall is put down to its culprit waiting for a CPU (Activity.cpu_wait), so a rank
hung on a starved host, spinning, is still named: by 1 / (1 - this) = 4 times the bound at the latest."""
JUDGE_EVERY_SECONDS = 0.25
"""The leader tests for a stall this often (two numbers; the whole picture only when due), and also
right when a stall reaches its bound (`seconds_until_due`)."""
MAX_WAITING_LISTED = 64
"""evidence.waiting lists at most this many ranks (waiting_count has them all)."""


ENDED = (RankState.GONE, RankState.CRASHED)
"""States of a rank whose process ended without finishing: a crash, told by the rank (crashed, with
its exception) or seen by its node (gone: the pid vanished, or its node stopped hearing from it)."""
PEER_LOST_MARKS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "econnreset",
    "communicator was aborted",
    "nccl communicator",
    "socket timeout",
    "timed out",
)
"""Words in a crashed rank's error that say it failed because a peer went away: an echo of the first
failure, not the cause (gloo's and NCCL's messages)."""


EVIDENCE_RULES = (BuiltinRule.HANG, BuiltinRule.RANK_GONE)
"""Findings whose decision keeps every reachable rank's evidence beside it (parwatch.sidecar.evidence); not
the echoes of a failure already named (their ranks are ending)."""

ECHO_WAIT_SECONDS = 8.0
"""When the ranks that ended only lost a peer or ended silently, the one that failed first may not be told
yet: wait at most this long (past a node's digest grace, 5 s) for it to be, or for its node to go missing."""


FIRST_FORWARD_SECONDS = 2.0
"""A rank the leader never heard of may be one a node has not forwarded yet (a node forwards a rank's first
report at once, then once a second): echoes wait this long for it before the failure is put among the unseen."""


def lost_a_peer(a: Activity) -> bool:
    """A crashed rank whose exception says a peer went away first."""
    return a.state == RankState.CRASHED and a.error is not None and any(m in a.error.lower() for m in PEER_LOST_MARKS)


def ended_at(a: Activity) -> float:
    """When an ended rank ended, as well as known: the exit its node saw, else its last report."""
    return a.ended if a.ended is not None else a.time


def ended_later(a: Activity, b: Activity) -> bool:
    """Whether the node of both saw `a`'s process end after `b`'s (one host's clock: comparable)."""
    return a.ended is not None and b.ended is not None and a.host == b.host and a.ended > b.ended


def told_its_cause(a: Activity) -> bool:
    """A rank that crashed of its own exception (not an echo): the cause, whatever else ended."""
    return a.state == RankState.CRASHED and not lost_a_peer(a)


def _always_heard(since: float) -> bool:
    return True


_INSTANCE_OF: dict[str, attrgetter] = {
    GroupRole.TP: attrgetter("dp_rank", "stage"),
    GroupRole.PP: attrgetter("dp_rank", "tp_rank"),
    GroupRole.DP: attrgetter("stage", "tp_rank"),
}
"""Which instance of a group role a rank's collective is in: the coordinates its members share (the
world has one instance)."""


def group_members(layout: RankLayout, group: str, a: Activity) -> range:
    """Global ranks of `a`'s instance of group role `group`, in the run's order; the world for any other role."""
    if group in ROLES:
        return layout.group(group, Coords(a.tp_rank, a.stage, a.dp_rank))
    return range(layout.world)


@dataclass(frozen=True)
class HangSettings:
    min_seconds: float = 2.75
    """A hang needs at least this long without a step boundary. Under issue 44's goal of a hang named within
    max(1.5 x median step, 3 s): the leader's wake-up and the reports' transit come after the bound."""
    step_factor: float = 1.4
    """... and at least this many median step times (under the goal's 1.5, for the same reason)."""
    busy_seconds: float = 60.0
    """A rank inside a declared long activity (a checkpoint save, an eval pass; every rank before its first
    step: warm-up, compilation; a rollback's checkpoint load) is busy, not stalled, until
    max(busy_seconds, BUSY_STEP_FACTOR x median step)."""
    dump_stacks: bool = False
    """Signal the culprit (SIGUSR1) to write its Python stacks into the run directory."""
    abort: bool = False
    """Tell every rank to exit with HANG_EXIT_CODE so the launcher/JobSet restarts from a checkpoint."""
    requeue: bool = False
    """Requeue the Slurm job (the hang's decision has action requeue while the requeuer allows it)."""

    def __post_init__(self):
        if not self.min_seconds > 0:
            raise ValueError(
                f"--hang-min-seconds must be > 0 (got {self.min_seconds}); {HangSettings.min_seconds:g} suits most runs"
            )
        if not self.step_factor >= 1:
            raise ValueError(
                f"--hang-step-factor must be >= 1 (got {self.step_factor}); {HangSettings.step_factor:g} suits most runs"
            )
        if not self.busy_seconds >= self.min_seconds:
            raise ValueError(
                f"--hang-busy-seconds must be >= --hang-min-seconds (got {self.busy_seconds}, {self.min_seconds}); "
                "60 suits most runs"
            )


# --------------------------------------------------------------------------- pure analysis


_P2P = (SpanKind.RECV, SpanKind.SEND)


def _answered(a: Activity, rows: Mapping[int, Activity]) -> bool:
    """A send whose peer is in the matching receive from it: the data is not flowing out of this rank, so
    it waits for nobody (its own transport, or the rank itself, is stuck) and its peer waits for it."""
    if a.kind != SpanKind.SEND or a.peer is None:
        return False
    peer = rows.get(int(a.peer))
    return peer is not None and peer.kind == SpanKind.RECV and peer.peer == a.rank


def _posted(a: Activity, rows: Mapping[int, Activity]) -> bool:
    """A receive whose send is posted: its peer's report says it posted at least `seq` sends to this rank
    (the k-th receive from a peer is its k-th send). The data is on its way, or stuck in the transport:
    the receiver waits for nobody. Not when the peer's device is stuck before it (the send is queued
    behind that work), nor while the peer is still in its send to this rank (_answered names the sender)."""
    if a.kind != SpanKind.RECV or a.peer is None or a.seq is None:
        return False
    peer = rows.get(int(a.peer))
    if peer is None or not peer.sent or _device_stuck(peer):
        return False
    if peer.kind == SpanKind.SEND and peer.peer == a.rank:
        return False  # the peer is still in that send (a blocking send, stuck): it is the one waited for
    return any(p == a.rank and n >= a.seq for p, n in peer.sent)


def _instance(a: Activity) -> tuple:
    """The group call a rank is in, as its members' rows tell it (the boundary has no seq: by step)."""
    return (a.kind, a.group, a.op, a.seq if a.seq is not None else a.step)


def _device_stuck(a: Activity) -> bool:
    """Its CUDA device stayed on one span's own work (not a collective's): whatever its host waits in,
    the rank waits for nobody."""
    return a.device_since is not None and a.device_kind not in _COMM_KINDS


_GROUP_KINDS = (SpanKind.COLLECTIVE, SpanKind.BOUNDARY, SpanKind.DP_SYNC)
"""Spans that wait for a group when they name one: a collective, the boundary (an all-reduce over the world),
and a gradient sync that names its group (Megatron's finalize_model_grads, whose DP all-reduce is not hooked)."""
_COMM_KINDS = frozenset((*_P2P, *_GROUP_KINDS))
_WAITING_STATES = (RankState.RUNNING, *ENDED)  # an ended rank's last wait still tells who went first


def find_culprit(rows: Mapping[int, Activity], layout: RankLayout, fresh_after: float | None = None) -> dict | None:
    """The rank the others wait for, with who waits; None when no rank is known.

    Returns {"culprit": rank, "waiting": [ranks...] (transitive), "missing": what it has not joined
    (a Missing, or None), "method": "dependency" | "oldest-span", "kind": HangKind (see hang_kind), "waits_on":
    {rank: [the ranks it waits for directly]} for the first MAX_WAITING_LISTED of `waiting`}.

    One pass over the ranks, then work per wait, not per rank: the ranks in one collective instance
    wait together for the members not in it, so a whole world in one all-reduce is one set, and who
    (transitively) waits for a rank is found by set unions. The leader runs this on its event loop at
    16,384 ranks (docs/benchmarks.md, the leader).
    """
    waits = Waits(rows)
    waits.add(rows)
    return waits.culprit(layout, fresh_after)


class Waits:
    """Who waits in what, from every rank's row: find_culprit's one pass over the ranks, which the leader
    takes in slices between posts (Survey), then the search, whose work is per wait."""

    def __init__(self, rows: Mapping[int, Activity]):
        self.rows = rows
        self.arrived: dict[tuple, set[int]] = {}  # collective instance -> the ranks in it
        self.p2p: dict[int, int] = {}  # rank in a recv or an unanswered send -> its peer
        self.key_of: dict[int, tuple] = {}  # rank in a collective -> its instance

    def add(self, ranks: Iterable[int]) -> None:
        """Some ranks' rows (each rank once over all the calls)."""
        rows, arrived, p2p, key_of = self.rows, self.arrived, self.p2p, self.key_of
        instance_of = _INSTANCE_OF.get
        for rank in ranks:
            a = rows[rank]
            kind = a.kind
            if kind is None or a.state not in _WAITING_STATES or _device_stuck(a):
                continue  # a rank whose device is stuck on its own work waits for nobody, whatever its host is in
            if kind in _P2P:
                if a.peer is not None and not _answered(a, rows) and not _posted(a, rows):
                    p2p[rank] = int(a.peer)
            elif kind in _GROUP_KINDS and (group := a.group):
                seq = a.seq if a.seq is not None else ("step", a.step)  # no seq (the boundary): line up by step
                of = instance_of(group)
                key = key_of[rank] = (group, of(a) if of is not None else (), a.op, seq)
                present = arrived.get(key)
                if present is None:
                    arrived[key] = {rank}
                else:
                    present.add(rank)

    def culprit(self, layout: RankLayout, fresh_after: float | None = None) -> dict | None:
        """find_culprit's answer, once every rank was added."""
        rows, arrived, p2p, key_of = self.rows, self.arrived, self.p2p, self.key_of
        if not rows:
            return None
        # Reverse edges, waited-for -> who waits: a collective instance waits for its members not in it.
        groups_waiting: dict[int, list[tuple]] = {}
        absent: dict[tuple, list[int]] = {}  # instance -> its members not in it
        for key, present in arrived.items():
            members = group_members(layout, key[0], rows[next(iter(present))])
            if len(present) < len(members):
                absent[key] = missing_members = sorted(set(members).difference(present))
                for m in missing_members:
                    groups_waiting.setdefault(m, []).append(key)
        ranks_waiting: dict[int, list[int]] = {}
        for rank, peer in p2p.items():
            ranks_waiting.setdefault(peer, []).append(rank)
        waited_for = groups_waiting.keys() | ranks_waiting.keys()
        blocked = set(p2p).union(*arrived.values())

        def waiting_for(sink: int) -> set[int]:
            reached: set[int] = set()
            frontier = {sink}
            while frontier:
                new: set[int] = set()
                for r in frontier:
                    for key in groups_waiting.get(r, ()):
                        new |= arrived[key]
                    new.update(ranks_waiting.get(r, ()))
                new -= reached
                new.discard(sink)
                reached |= new
                frontier = new & waited_for  # a rank nobody waits for leads no further
            return reached

        sinks = [r for r in waited_for if r not in blocked]
        if not sinks:
            if not blocked:  # nobody waits for anybody: everyone is stuck in its own work
                oldest = min(rows.values(), key=lambda a: (a.since if a.since is not None else float("inf"), a.rank))
                kind, on = hang_kind(oldest, rows, None)
                return {
                    "culprit": oldest.rank,
                    "waiting": [],
                    "missing": None,
                    "method": "oldest-span",
                    "kind": kind,
                    "kind_waits_on": on,
                    "waits_on": {},
                }
            sinks = list(blocked)  # a cycle (mismatched collectives): the one open longest is the best guess
        best = None
        for sink in sinks:
            reached = waiting_for(sink)
            row = rows.get(sink)
            since = row.since if row is not None and row.since is not None else float("inf")
            # A sink whose activity predates the stall (fresh_after) may just be a late report: prefer fresh ones.
            fresh = row is not None and (fresh_after is None or row.time >= fresh_after)
            score = (fresh, len(reached), -since, -sink)
            if best is None or score > best[0]:
                best = (score, sink, reached)
        assert best is not None  # sinks is never empty here
        _, culprit, reached = best
        missing = None
        if culprit in groups_waiting:  # name the collective it has not joined: the first seen waiting for it
            group, _instance, op, seq = groups_waiting[culprit][0]
            missing = Missing(
                kind=SpanKind.COLLECTIVE, op=op, group=group, seq=seq if not isinstance(seq, tuple) else None
            )
        elif culprit in ranks_waiting:
            by = ranks_waiting[culprit][-1]
            missing = Missing(kind=SpanKind.SEND if rows[by].kind == SpanKind.SEND else SpanKind.RECV, by=by)
        waiting = sorted(reached)

        def direct(r: int) -> list[int]:
            if r in p2p:
                return [p2p[r]]
            key = key_of.get(r)
            return absent.get(key, [])[:MAX_WAITING_LISTED] if key is not None else []

        row = rows.get(culprit)
        kind, on = hang_kind(row, rows, absent.get(key_of.get(culprit, ())) if row is not None else None)
        return {
            "culprit": culprit,
            "waiting": waiting,
            "missing": missing,
            "method": "dependency",
            "kind": kind,
            "kind_waits_on": on,
            "waits_on": {r: direct(r) for r in waiting[:MAX_WAITING_LISTED]},
        }


def hang_kind(
    a: Activity | None, rows: Mapping[int, Activity], absent: list[int] | None
) -> tuple[HangKind | None, list[int]]:
    """What kind of hang the culprit's row shows, and the ranks it waits on (HangKind):
    device     (CUDA) its device stayed on one span's work while its host waits (event queries);
    transport  it is in a collective every member entered, or a send or receive whose other end is in
               (the matching receive, the posted send): the bytes do not move;
    peer       it waits in a send, receive or collective for ranks that are not in it (a cycle of
               waits, or ranks the leader does not see);
    host       its host thread is in its own work (compute, data, a checkpoint, between spans): blocked
               in Python or below it.
    (None, []) for a rank the leader has no current report of."""
    if a is None or a.state == RankState.UNKNOWN:
        return None, []
    if a.device_since is not None:
        return (HangKind.TRANSPORT if a.device_kind in _COMM_KINDS else HangKind.DEVICE), []
    if a.kind in _P2P:
        if _answered(a, rows) or _posted(a, rows):
            return HangKind.TRANSPORT, [int(a.peer)] if a.peer is not None else []
        return HangKind.PEER, [int(a.peer)] if a.peer is not None else []
    if a.kind in _GROUP_KINDS and a.group:
        return (HangKind.PEER, absent) if absent else (HangKind.TRANSPORT, [])
    return HangKind.HOST, []


def _seconds_or_none(x) -> float | None:
    """A finite number as float, else None: rows are validated at ingest (parwatch.wire.activity), and
    the stall clock still checks what it uses, for callers that build Activity rows themselves."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


class Progress:
    """When the run last crossed a step boundary (on the leader's clock), and the bound a hang must exceed."""

    def __init__(self, settings: HangSettings, window: int = 64):
        self.settings = settings
        self.step = -1
        """The step of the newest boundary (it goes down after a rollback: boundaries, not steps, are progress)."""
        self.time: float | None = None
        """The stall's start: when the newest boundary ended, on the leader's clock (boundary_time)."""
        self.sampled: float | None = None
        """The ranks' wall clock when the newest boundary was first seen: reports older than this predate the stall."""
        self.last_end: float | None = None
        """The newest boundary's end on the ranks' clock (activity.step_end): a later one is a new boundary,
        whatever its step number, so a rollback's replay is progress."""
        self.switching = False
        """Set by rearm() (a rollback or resume): judged with the start-up bound until the next boundary."""
        self.busy_seen: float | None = None
        """When a report last showed a rank inside a declared long activity, or first showed it out of one (the
        leader's clock)."""
        self._seconds: deque = deque(maxlen=window)

    def observe(
        self,
        step: int,
        step_seconds: float | None,
        now: float,
        sampled: float | None = None,
        step_end: float | None = None,
    ) -> bool:
        """now: the leader's clock at arrival; sampled: the rank's wall clock when it sampled the step;
        step_end: the rank's wall clock when it ended that step (its boundary). True on a new boundary."""
        if self.time is None:
            self.time = now  # the clock starts at the first report: startup counts towards the bound
        step_end = _seconds_or_none(step_end)
        # A higher step is a new boundary; so is a later boundary end at any step (a rollback's replay).
        new = step > self.step or (step_end is not None and (self.last_end is None or step_end > self.last_end))
        if not new:
            return False
        sampled = _seconds_or_none(sampled)
        start = self.boundary_time(now, sampled, step_end)
        # A later boundary is not earlier than the one before (a clock stepped back, a clamp, a rearm).
        self.time = max(self.time, start) if self.step >= 0 or self.switching else start
        self.step = step
        if step_end is not None:
            self.last_end = step_end if self.last_end is None else max(self.last_end, step_end)
        self.sampled = sampled if sampled is not None else now
        self.switching = False
        if step_seconds is not None and step_seconds > 0:
            self._seconds.append(float(step_seconds))
        return True

    def rearm(self, at: float) -> None:
        """The run switched timelines or resumed at `at` (leader's clock): the stall starts there, and
        until the next boundary it is judged with the start-up bound (a checkpoint load is slow)."""
        if self.time is None or at > self.time:
            self.time = at
        self.switching = True

    @staticmethod
    def boundary_time(now: float, sampled: float | None, step_end: float | None) -> float:
        """When the step boundary ended, on the leader's clock, from a report that arrived at `now`.

        The rank's own clock says when it ended the step (step_end) and how old that was when it
        sampled the report (sampled - step_end: one clock, so no skew in it). The report was
        sampled before it arrived and at most MAX_REPORT_LATENCY_SECONDS earlier, so the boundary
        lies in [now - age - MAX_REPORT_LATENCY_SECONDS, now - age]. Within that window the rank's
        clock is taken as the leader's (NTP keeps them milliseconds apart); a rank whose clock is
        skewed is clamped to the window's edge: a clock behind can start the stall at most
        MAX_REPORT_LATENCY_SECONDS early, one ahead at most the report's transit late (~1 s) —
        never a hang out of nothing, never one named a skew's worth late.
        Without step_end (a report that carries none, as a test's may) the sample time stands in for it
        (age 0); without either, the arrival.
        """
        if sampled is None:
            return now
        if step_end is None:
            step_end = sampled
        latest = now - max(sampled - step_end, 0.0)
        return min(max(step_end, latest - MAX_REPORT_LATENCY_SECONDS), latest)

    def median_step_seconds(self) -> float | None:
        return statistics.median(self._seconds) if self._seconds else None

    def bound(self) -> float:
        """max(step_factor x median step, min_seconds); before the first step completes, and after a
        rollback or resume until the next boundary, the busy bound: start-up (imports, process groups,
        the first step's compilation, a checkpoint load) is a declared long activity, with no median yet."""
        if self.step < 1 or self.switching:
            return self.busy_bound()
        median = self.median_step_seconds()
        return max(self.settings.step_factor * median if median else 0.0, self.settings.min_seconds)

    def busy_bound(self) -> float:
        """How long a rank inside a declared long activity (a checkpoint save, an eval pass, start-up) may
        keep the run from a boundary: max(busy_seconds, BUSY_STEP_FACTOR x median step)."""
        median = self.median_step_seconds()
        return max(BUSY_STEP_FACTOR * median if median else 0.0, self.settings.busy_seconds)

    def stalled_for(self, now: float) -> float:
        """The stall the bound judges: since the last boundary, or since a rank was last seen busy in a
        declared long activity (a checkpoint save, an eval pass: that time is not a stall), if later."""
        if self.time is None:
            return 0.0
        return max(now - max(self.time, self.busy_seen or self.time), 0.0)

    def since_boundary(self, now: float) -> float:
        """Since the last boundary, busy time included: what the busy bound judges."""
        return 0.0 if self.time is None else max(now - self.time, 0.0)


# --------------------------------------------------------------------------- the leader's state

MAX_LISTED = 16


def coverage(
    rows: Mapping[int, Activity], world: int, missing_nodes: list[NodeMissing], seen: int | None = None
) -> Coverage:
    """What the leader sees of the run: ranks with a current report (`seen`, when counted already), of the
    world; the nodes whose digests stopped; ranks never reported (first MAX_LISTED)."""
    if seen is None:
        seen = sum(1 for a in rows.values() if a.state != RankState.UNKNOWN)
    never = list(islice((r for r in range(world) if r not in rows), MAX_LISTED)) if len(rows) < world else []
    return Coverage(ranks_seen=seen, world=world, nodes_missing=missing_nodes[:MAX_LISTED], ranks_never_seen=never)


SURVEY_SLICE = 1024
"""Ranks per slice of the leader's survey, between which its loop answers posts: at 16,384 ranks the passes
over every rank took 20-60 ms at once, and every digest posted meanwhile waited for them."""
SURVEY_PAUSE_SECONDS = 0.002
"""The leader's pause between slices. Not a bare yield: a post takes several turns of the loop (read, decode,
answer), and with the survey ready again at every turn each post waited a slice per turn (p99 of the hung
phase 14-22 ms as before); a pause lets the posts that came during a slice finish before the next one."""


class Survey:
    """A judgement's passes over every rank of one picture, taken once: the ranks it sees (coverage), the
    ranks ended, the running ranks whose reports predate the stall, the oldest arrival of a running rank's
    current report (late reports), and who waits in what (Waits). The leader takes it in slices between
    posts (`slices`); check() takes one whole when given none."""

    def __init__(
        self, rows: Mapping[int, Activity], heard: Mapping[int, tuple[float, float]], fresh_after: float | None
    ):
        self.rows = rows
        self.waits = Waits(rows)
        self.fresh_after = fresh_after
        """Reports sampled before this predate the stall (the newest boundary, less the clocks' skew)."""
        self.seen = 0
        self.stale = 0
        self.ended: dict[int, int] = {}
        """rank -> the pid of its process, for the ranks whose process ended (gone, crashed)."""
        self.running: list[int] = []
        """The ranks running (reachable: a decision's evidence is asked of them)."""
        self.oldest_heard = math.inf
        self._heard = heard
        self._found: dict[float | None, dict | None] = {}

    def take(self, ranks: Sequence[int]) -> None:
        """Some ranks' rows (each rank once over all the calls)."""
        rows, heard, fresh_after, ended, running = self.rows, self._heard, self.fresh_after, self.ended, self.running
        for rank in ranks:
            a = rows[rank]
            state = a.state
            if state == RankState.RUNNING:
                self.seen += 1
                running.append(rank)
                if fresh_after is not None and a.time < fresh_after:
                    self.stale += 1
                h = heard.get(rank)
                if h is not None and h[0] == a.time and h[1] < self.oldest_heard:
                    self.oldest_heard = h[1]
            elif state != RankState.UNKNOWN:
                self.seen += 1
                if state in ENDED:
                    ended[rank] = a.pid
        self.waits.add(ranks)

    def slices(self) -> Iterator[None]:
        """Take every rank, SURVEY_SLICE at a time, yielding between slices. By rank number, not (rank, row)
        pairs: 16,384 tuples that live through the survey are tracked by the collector, and pushed a full
        collection onto the leader's loop."""
        ranks = list(self.rows)
        for i in range(0, len(ranks), SURVEY_SLICE):
            self.take(ranks[i : i + SURVEY_SLICE])
            yield

    def culprit(self, layout: RankLayout, fresh_after: float | None) -> dict | None:
        """find_culprit's answer for this picture (searched once per `fresh_after`: the leader searches in a
        step of its own, before the judgement asks)."""
        if fresh_after not in self._found:
            self._found[fresh_after] = self.waits.culprit(layout, fresh_after)
        return self._found[fresh_after]

    def whole(self) -> Survey:
        self.take(list(self.rows))
        return self

    def late(self, now: float) -> bool:
        """A running rank's newest report reached the leader over LATE_REPORT_SECONDS ago."""
        return now - self.oldest_heard > LATE_REPORT_SECONDS

    def coverage(self, world: int, missing_nodes: list[NodeMissing]) -> Coverage:
        return coverage(self.rows, world, missing_nodes, self.seen)


def _coverage_text(cov: Coverage | None) -> str:
    if cov is None or cov.ranks_seen >= cov.world:
        return ""
    text = f"; sees {cov.ranks_seen} of {cov.world} ranks"
    if cov.nodes_missing:
        text += " (nodes missing: " + ", ".join(f"{m.node} since {m.since:.0f}" for m in cov.nodes_missing) + ")"
    if cov.ranks_never_seen:
        text += f" (never reported: ranks {cov.ranks_never_seen})"
    return text


def _describe(c: Culprit) -> str:
    what = c.kind or "between spans"
    if c.op and c.op != c.kind:
        what += f" {c.op}"
    if c.group:
        what += f" group={c.group}"
    if c.peer is not None:
        what += f" peer={c.peer}"
    return (
        f"rank {c.rank} (stage {c.stage}, tp_rank {c.tp_rank}, dp_rank {c.dp_rank}, host {c.host}, pid {c.pid}) "
        f"in {what}"
    )


_KIND_TEXT = {
    HangKind.HOST: "host blocked",
    HangKind.PEER: "waiting on a peer",
    HangKind.TRANSPORT: "transport stall",
    HangKind.DEVICE: "device busy",
}


def _missing_text(missing: Missing | None) -> str:
    if missing is None:
        return ""
    if missing.kind == SpanKind.COLLECTIVE:
        seq = f" #{missing.seq}" if isinstance(missing.seq, int) else ""
        return f"; it has not joined {missing.op} group={missing.group}{seq}"
    direction = "to" if missing.kind == SpanKind.SEND else "from"
    return f"; rank {missing.by} waits in a {missing.kind} {direction} it"


_STATE_OF = {v: k for k, v in RANK_STATES.items()}


def _state_value(state: str) -> int:
    """A rank's RANK_STATES value for a state other than running (the culprit's) or done (left out)."""
    return (
        RANK_STATES[RankState.GONE]
        if state in ENDED
        else RANK_STATES.get(RankState(state), RANK_STATES[RankState.HUNG])
    )


def _starved(rows: Mapping[int, Activity], found: dict, window: float) -> float | None:
    """The seconds of the stall judged (`window`: since the boundary, or since the culprit entered its span)
    that the culprit, or a rank it waits on (a peer it waits for, a transport stall's other end), spent
    waiting for a CPU, at most MAX_STARVED_SHARE of it; None where their nodes could not tell. A node counts
    a rank's wait since its boundary and since it entered its open span (Activity.cpu_wait, span_cpu_wait):
    the culprit's in its span (what it waited before it blocked there is no part of the window), the others'
    since the boundary (they move from span to span while the culprit waits for them)."""
    culprit = rows.get(found["culprit"])
    told = [culprit.span_cpu_wait] if culprit is not None else []
    told += [a.cpu_wait for r in found["kind_waits_on"] if (a := rows.get(r)) is not None]
    waits = [w for w in told if w is not None]  # set by its node for a live process only
    if not waits:
        return None
    return min(max(waits), MAX_STARVED_SHARE * window)


class HangMonitor:
    """The leader's hang/crash judgement: `due` asked every `every` seconds, `check` when due.

    engine: has record_finding(rule, action, reason, evidence, step) -> decision record.
    every: how often the leader asks (it also asks right when a stall reaches its bound); a hang is
    decided at stalled >= bound, never before.
    requeue: with settings.requeue, the SlurmRequeue (parwatch/sidecar/requeue.py) whose verdict makes a
    hang's action requeue or, saying why not, alert.
    """

    def __init__(self, settings: HangSettings, engine, clock, every: float = JUDGE_EVERY_SECONDS, requeue=None):
        self.settings = settings
        self.requeue = requeue
        self.engine = engine
        self.clock = clock
        self.every = every
        self.progress = Progress(settings)
        self.layout: RankLayout | None = None
        self.hang: dict | None = None
        """The current hang episode's decision record (None while the run progresses)."""
        self.gone_reported: set[int] = set()
        """Ranks a rank-gone decision already named."""
        self.cause: Culprit | None = None
        """The culprit of this run's first rank-gone record that named one: a rank that later dies of a
        peer's loss is its echo, never the culprit of a later record."""
        self._echoes_since: float | None = None
        """When the leader first saw a rank end that only lost a peer (ECHO_WAIT_SECONDS)."""
        self.findings: list[dict] = []
        """Decision records made (newest last; also in the engine's log)."""
        self.asked_stall = 0.0
        """The stall the last ask (due()) saw."""
        self.awaiting_fresh = False
        """The last check() held a hang back for a picture taken after the stall began (a late digest):
        ask again at the next ask, not once a second."""
        self.checked_stall = 0.0
        """The stall the last check() judged: past the bound, a hang was either named then or is none."""
        self.held_until: float | None = None
        """The last check() held a hang back: the rank the others wait for entered its current span less than
        the decision line ago (a slow step, still moving). When it will have been in it that long (this clock):
        the leader asks again right then, not at its once-a-second tick."""
        self.run_id = ""
        """The run judged, as its ranks' reports name it (the hub sets it): its evidence bundles are named by it."""
        self.busy: dict | None = None
        """The last check() held a hang back: its culprit is busy in a declared long activity (rank, busy, since)."""
        self._lost_since: float | None = None
        """The stall (its start) already recorded as a node lost."""
        self._sidecars_lost: set[str] = set()
        """Nodes a sidecar-lost finding named while they stay missing."""
        self._heard: dict[int, tuple[float, float]] = {}
        """rank -> (its newest sample's time, when it reached the leader): late reports (Survey.late)."""
        self._ended: dict[int, int] = {}
        """rank -> the pid of its process seen ending (gone, crashed): another pid is its restart (observe)."""
        self._busy_ranks: set[int] = set()
        """Ranks whose newest report showed them in a declared long activity (observe)."""

    def begin_run(self) -> None:
        """Another run reports now: its stall clock starts afresh (start-up bound), nothing carried over."""
        self.progress = Progress(self.settings)
        self.layout, self.hang, self.gone_reported, self._echoes_since = None, None, set(), None
        self.cause = None
        self.busy, self._lost_since, self._sidecars_lost, self._heard = None, None, set(), {}
        self._ended, self._busy_ranks = {}, set()

    def observe(self, a: Activity, layout: RankLayout, now: float, age: float = 0.0) -> None:
        """Every activity row as it arrives (cheap: the progress clock, and when its rank last spoke).
        `age`: how old the sample already was when it left its node (a digest's time less the row's, one
        host's clock), so a sample that waited for its node's digest is not taken as fresh."""
        self.layout = layout
        heard = self._heard.get(a.rank)
        if heard is None or heard[0] != a.time:  # a new sample (a digest repeats a rank's latest one)
            self._heard[a.rank] = (a.time, now - min(max(age, 0.0), MAX_REPORT_LATENCY_SECONDS))
        if a.state in ENDED:
            self._ended[a.rank] = a.pid
            self._busy_ranks.discard(a.rank)
        elif a.state == RankState.RUNNING:
            if self._ended.get(a.rank, a.pid) != a.pid and a.step_end is None:
                # A new process of a rank seen ending, before its first boundary (a restart under the same
                # run id): its start-up and checkpoint load are a declared long activity, as a rollback's
                # load is. Only after an end: a rank cannot hold the stall clock back by new pids alone.
                del self._ended[a.rank]
                self.progress.rearm(now)
            if a.busy is not None:
                self.progress.busy_seen = now
                self._busy_ranks.add(a.rank)
            elif a.rank in self._busy_ranks:  # its first report out of it: the activity ended by now, not by the
                self._busy_ranks.discard(a.rank)  # last busy report (sampled up to an interval before its end)
                self.progress.busy_seen = now
            if (
                self.progress.observe(a.step, a.step_seconds, now, a.time, a.step_end)
                and self.hang is not None
                and (a.step_end is not None or a.step > self.hang["step_at"])
            ):
                self.hang = None  # boundaries again: the episode is over

    def survey(self, rows: Mapping[int, Activity]) -> Survey:
        """A survey of `rows` for check(), none of it taken yet."""
        sampled = self.progress.sampled
        return Survey(rows, self._heard, None if sampled is None else sampled - CLOCK_SKEW_SECONDS)

    def _culprit_rank(self) -> int | None:
        named = finding_evidence(self.hang) if self.hang is not None else None
        return named.culprit.rank if isinstance(named, HangEvidence) and named.culprit else None

    def rank_states(self, rows: Mapping[int, Activity]) -> dict[int, int]:
        """rank -> RANK_STATES value (parwatch_rank_state): gone, hung (the culprit, or a frozen rank), running."""
        culprit = self._culprit_rank()
        running, hung = RANK_STATES[RankState.RUNNING], RANK_STATES[RankState.HUNG]
        out = {}
        for r, a in rows.items():  # a plain loop: at the leader, every rank at every scrape
            state = a.state
            if state == RankState.RUNNING:
                out[r] = hung if r == culprit else running
            elif state != RankState.DONE:
                out[r] = _state_value(state)
        return out

    def state_counts(self, rows: Mapping[int, Activity]) -> dict[RankState, int]:
        """How many ranks are in each RANK_STATES state, as rank_states() tells them (done ones left out)."""
        counts: dict[RankState, int] = {}
        for state, n in Counter(a.state for a in rows.values()).items():
            if state != RankState.DONE:
                name = RankState.RUNNING if state == RankState.RUNNING else _STATE_OF[_state_value(state)]
                counts[name] = counts.get(name, 0) + n
        culprit = self._culprit_rank()
        if culprit is not None and (a := rows.get(culprit)) is not None and a.state == RankState.RUNNING:
            counts[RankState.RUNNING] -= 1
            counts[RankState.HUNG] = counts.get(RankState.HUNG, 0) + 1
        return counts

    def due(self, paused: bool = False, gone_hint: bool = True) -> bool:
        """Whether check() has anything to judge: a rank reported gone, or a stall past the bound (or a
        long activity past the busy bound) not yet recorded. The leader builds the whole picture (every
        rank) only then."""
        now = self.clock()
        self.asked_stall = self.progress.stalled_for(now)
        if gone_hint:
            return True
        due = not paused and self.hang is None and (self.stalled_past_bound(self.asked_stall) or self._busy_past(now))
        if not due:
            self.held_until = None
        return due

    def _busy_past(self, now: float) -> bool:
        """A rank seen busy lately, and the run without a boundary for (about) the busy bound."""
        p = self.progress
        return p.busy_seen is not None and p.busy_seen >= (p.time or 0.0) and (p.since_boundary(now) >= p.busy_bound())

    def seconds_until_due(self) -> float | None:
        """Seconds until a stall passes the decision line; 0 when it passed since the last ask (which came
        just before it: ask now, not one ask late); None while a hang is recorded, nothing has reported,
        or an ask already saw the stall past the line. The leader's loop sleeps no longer than this, so it
        asks right at the line, not up to JUDGE_EVERY_SECONDS after it."""
        if self.hang is not None or self.progress.time is None:
            return None
        line = self.decision_line()
        until = line - self.progress.stalled_for(self.clock())
        if until > 0:
            return until
        if self.held_until is not None:
            return max(self.held_until - self.clock(), 0.0)
        return 0.0 if self.asked_stall < line else None

    def decision_line(self) -> float:
        """The stall a hang is decided at: the bound itself. Not a check earlier (as before 2026-12-05): that
        named stalls of bound - 0.25 s that were about to end (issue 44: a stall shorter than the bound is
        never named); the leader's loop wakes right at the line (`seconds_until_due`), so it is not late."""
        return self.progress.bound()

    def stalled_past_bound(self, stalled: float) -> bool:
        return stalled >= self.decision_line()

    def check(
        self,
        rows: Mapping[int, Activity],
        paused: bool = False,
        coverage: Coverage | None = None,
        heard_since: Callable[[float], bool] = _always_heard,
        survey: Survey | None = None,
    ) -> list[dict]:
        """Judge the picture: a crash (rank-gone) or a hang. `coverage` (see coverage()): what the
        leader sees; every finding carries it, and no culprit is named among ranks it cannot see.
        `heard_since(t)`: whether every node still heard from has sent a digest since t (the leader).
        `survey`: of `rows`, taken (the leader takes it in slices); else taken here."""
        survey = survey if survey is not None else self.survey(rows).whole()
        now = self.clock()
        self.checked_stall = self.progress.stalled_for(now)
        self.held_until = None
        records = self._judge_crashes(survey, now, coverage, heard_since)
        self._ended.update(survey.ended)  # their processes' restarts start up under the start-up bound (observe)
        crashed = bool(survey.ended)  # a stall after a crash is the crash's
        stalled, bound, past, fresh_after, stale = self._progress(survey, now, quiet=paused or crashed)
        if self.awaiting_fresh:
            return records
        if self._lost_since is not None and self._lost_since == self.progress.time:
            return records  # this stall was a node lost, already recorded
        if not paused and not crashed and past and self.layout is not None and rows:
            records += self._judge_hang(survey, now, fresh_after, stalled, bound, stale, coverage)
        return records

    # -- crash classification -------------------------------------------------------------------------

    def _judge_crashes(
        self, survey: Survey, now: float, coverage: Coverage | None, heard_since: Callable[[float], bool]
    ) -> list[dict]:
        """rank-gone records for the ranks newly ended: the first failure named, echoes told apart."""
        records = []
        rows = survey.rows
        gone = self._newly_gone(survey)
        if self.cause is not None and any(lost_a_peer(a) for a in gone):
            # The run's first failure is named already: ranks that lost a peer since are its echoes.
            records.append(self._echo_record([a for a in gone if lost_a_peer(a)], coverage))
            gone = [a for a in gone if not lost_a_peer(a)]
        if any(lost_a_peer(a) for a in gone) and not any(told_its_cause(a) for a in gone):
            gone = self._wait_for_cause(rows, gone, now, coverage, heard_since, records)
        if gone:
            records.append(self._gone_record(rows, gone, coverage))
        return records

    def _newly_gone(self, survey: Survey) -> list[Activity]:
        """The ranks ended and not reported yet, the likeliest first failure first."""
        # A crash: a process ended. A rank that says it lost a peer is an echo; among the others, the
        # one the rest last waited for went first, else the earliest to end.
        return sorted(
            (survey.rows[r] for r in survey.ended if r not in self.gone_reported),
            key=lambda a: (lost_a_peer(a), ended_at(a), a.rank),
        )

    def _wait_for_cause(
        self,
        rows: Mapping[int, Activity],
        gone: list[Activity],
        now: float,
        coverage: Coverage | None,
        heard_since: Callable[[float], bool],
        records: list[dict],
    ) -> list[Activity]:
        """The ranks gone to name now ([] to wait) when echoes ended without the cause among them."""
        # Echoes, and maybe ranks gone without a word: a launcher ends a node's other workers once
        # one fails, so those may be echoes too until every node has spoken since the first echo.
        lost = sorted(r for r, a in rows.items() if a.state == RankState.UNKNOWN)
        never = coverage.ranks_never_seen if coverage is not None else []
        unseen = lost + never
        self._echoes_since = self._echoes_since if self._echoes_since is not None else now
        waited = now - self._echoes_since
        if never and not lost and waited < FIRST_FORWARD_SECONDS:
            gone = []  # ranks never heard of may be on their way from their node: its report may name the cause
        elif unseen:  # the first failure is among the ranks it cannot see: point there, name nobody
            records.append(self._unseen_cause(gone, unseen, coverage))
            gone = []
        elif waited < ECHO_WAIT_SECONDS and (all(lost_a_peer(a) for a in gone) or not heard_since(self._echoes_since)):
            gone = []  # the rank that failed first may yet be told, or its node go missing
        return gone

    def _gone_record(self, rows: Mapping[int, Activity], gone: list[Activity], coverage: Coverage | None) -> dict:
        """rank-gone naming the first of `gone` to fail (the culprit the waits point at, where they tell)."""
        first = self._first_to_fail(rows, gone)
        culprit = Culprit.of(first, first.error) if first.state == RankState.CRASHED else Culprit.of(first)
        others = [a.rank for a in gone[1:]]
        how = f"crashed ({first.error})" if first.state == RankState.CRASHED else "ended (its process is gone)"
        reason = f"rank-gone: {_describe(culprit)} {how}, last reported step {first.step}"
        if others:
            reason += f"; also gone: {others[:MAX_WAITING_LISTED]}"
        reason += _coverage_text(coverage)
        record = self._record(
            BuiltinRule.RANK_GONE,
            reason,
            RankGoneEvidence(culprit=culprit, gone=[first.rank] + others, coverage=coverage),
            first.step,
        )
        self.gone_reported.update(a.rank for a in gone)
        self._echoes_since = None
        if self.cause is None and not lost_a_peer(first):
            self.cause = culprit
        return record

    def _first_to_fail(self, rows: Mapping[int, Activity], gone: list[Activity]) -> Activity:
        """The rank of `gone` that failed first, moved to the front: the earliest unless the waits name one."""
        first = gone[0]
        if len(gone) > 1 and self.layout is not None and not any(told_its_cause(a) for a in gone):
            found = find_culprit(rows, self.layout)
            named = rows.get(found["culprit"]) if found else None
            # An echo is no cause; nor is a rank its node saw end after another of its ranks (stale
            # samples guess who waited for whom, the exits tell who ended first).
            if named is not None and named in gone and not lost_a_peer(named) and not ended_later(named, first):
                first = named
                gone.remove(named)
                gone.insert(0, named)
        return first

    # -- progress -------------------------------------------------------------------------------------

    def _progress(self, survey: Survey, now: float, quiet: bool) -> tuple[float, float, bool, float | None, int]:
        """(stalled, bound, past the decision line (or a long activity past its own), fresh_after, stale
        ranks); sets awaiting_fresh. `quiet`: paused or crashed (no hang judged, late reports not waited on)."""
        stalled = self.progress.stalled_for(now)
        busy_past = self._busy_past(now)
        bound = self.progress.bound()
        # Judge a picture taken after the stall began: a rank's activity sampled before the last step
        # boundary the leader saw (a late digest from a busy node) would read as still computing. Past
        # twice the bound, judge with what there is (a node's sidecar may be gone) and say so.
        stale, fresh_after = 0, None
        past = self.stalled_past_bound(stalled) or busy_past
        if self.progress.sampled is not None and past:
            fresh_after = self.progress.sampled - CLOCK_SKEW_SECONDS
            stale = (
                survey.stale
                if fresh_after == survey.fresh_after  # else a boundary came while the survey was taken
                else sum(1 for a in survey.rows.values() if a.state == RankState.RUNNING and a.time < fresh_after)
            )
        # A rank whose report is late may show it as before it stopped (a hiccup, a node stopped whole): wait
        # until it speaks again, goes silent, or its node goes missing (then its ranks read unknown).
        late = past and not quiet and survey.late(now)
        self.awaiting_fresh = (bool(stale) or late) and stalled < 2 * bound
        return stalled, bound, past, fresh_after, stale

    # -- hang judgement -------------------------------------------------------------------------------

    def _judge_hang(
        self,
        survey: Survey,
        now: float,
        fresh_after: float | None,
        stalled: float,
        bound: float,
        stale: int,
        coverage: Coverage | None,
    ) -> list[dict]:
        """The hang record of a stall past the decision line (once per episode), naming the rank the waits
        point at; none while that rank is busy in a declared long activity within its bound; a node lost
        (rank-gone) when the waits point at the ranks of a node gone quiet."""
        records: list[dict] = []
        assert self.layout is not None  # check() judges a hang only with a layout
        if self.hang is not None:  # named once this episode: searching every rank again (~30 ms at 16,384
            self.busy = None  # ranks, on the event loop every check) would change nothing but delay posts
            return records
        rows = survey.rows
        found = survey.culprit(self.layout, fresh_after)
        if found is None:
            return records
        rank = found["culprit"]
        a = rows.get(rank)
        busy = a.busy if a is not None and a.state == RankState.RUNNING else None
        in_span = self._still_for(rows, a, found["kind"], now) if a is not None else None
        window = stalled if in_span is None else min(stalled, in_span)
        cpu_wait = _starved(rows, found, window)
        starved = cpu_wait or 0.0
        if self.hang is None and (
            busy and not self._busy_past(now) or not busy and not self.stalled_past_bound(window - starved)
        ):
            # In a checkpoint save or an eval pass: busy, not stalled, until its own bound; or out of one a
            # moment ago, the stall counted from then; or the rank the others wait for entered its current
            # span less than the bound ago: a slow step, still moving, not a stall; or it spent enough of
            # the stall waiting for a CPU that the rest is under the bound: a starved host, still moving.
            self.busy = {"rank": rank, "busy": busy, "since": a.busy_since} if busy and a else None
            if not busy and self.stalled_past_bound(stalled):
                self.held_until = now + self.decision_line() - (window - starved)
            return records
        self.busy = None
        lost = coverage.nodes_missing if coverage is not None else []
        if self.hang is None and lost and (a is None or a.state == RankState.UNKNOWN):
            records.append(self._node_lost(rows, rank, lost, stalled, coverage))
            return records
        if self.hang is None and (a is None or a.state not in (*ENDED, RankState.DONE)):
            record = self._hang_record(found, a, busy, now, stalled, bound, stale, coverage, cpu_wait)
            self.hang = record
            records.append(record)
        return records

    def _still_for(self, rows: Mapping[int, Activity], a: Activity, kind: str | None, now: float) -> float | None:
        """How long the culprit's wait has been what it is judged as: its time in its current span; for a
        transport stall, since the last of its parties entered (its collective's members, the other end of
        its send or receive): until then a party was still moving (a rank stopped for a moment, then
        catching up), and the bytes could not flow. None when unknown."""
        in_span = self._in_span(a, now)
        if kind != HangKind.TRANSPORT or in_span is None or self.layout is None:
            return in_span
        if a.kind in _GROUP_KINDS and a.group:
            parties = [
                r for m in group_members(self.layout, a.group, a)
                if (r := rows.get(m)) is not None and _instance(r) == _instance(a)
            ]  # fmt: skip
        else:  # a send or receive: the other end, when it is in the matching receive or send
            peer = rows.get(int(a.peer)) if a.peer is not None else None
            parties = [peer] if peer is not None and peer.kind in _P2P and peer.peer == a.rank else []
        ages = [x for r in parties if (x := self._in_span(r, now)) is not None]
        return min([in_span, *ages])

    def _in_span(self, a: Activity, now: float) -> float | None:
        """How long a running rank has been in its current span, on the leader's clock: the span's age when
        sampled (the rank's clock, both ends) plus the time since that sample reached the leader (dated by
        its node's digest). None when unknown (between spans, or a row this monitor has not heard)."""
        heard = self._heard.get(a.rank)
        if a.state != RankState.RUNNING or a.since is None or heard is None or heard[0] != a.time:
            return None
        return max(a.time - a.since, 0.0) + max(now - heard[1], 0.0)

    def _hang_record(
        self,
        found: dict,
        a: Activity | None,
        busy: Busy | None,
        now: float,
        stalled: float,
        bound: float,
        stale: int,
        coverage: Coverage | None,
        cpu_wait: float | None = None,
    ) -> dict:
        rank = found["culprit"]
        waiting = found["waiting"]
        named_culprit = Culprit.of(a) if a is not None and a.state != RankState.UNKNOWN else None
        if named_culprit is not None:
            what = f"{_describe(named_culprit)} since {named_culprit.since}" + _missing_text(found["missing"])
        else:  # the waits point at a rank this leader has no current report of: say so, name none
            what = f"the ranks it sees wait for rank {rank}, of which it has no current report"
        since = self.progress.since_boundary(now)
        judged = f"busy in {busy} past its bound {self.progress.busy_bound():.0f} s" if busy else f"bound {bound:.3g} s"
        if cpu_wait and not busy:
            judged += f"; {cpu_wait:.2f} s of it waiting for a CPU, not counted"
        reason = (
            f"hang ({_KIND_TEXT.get(found['kind'], 'unseen')}): no step boundary for {since:.2f} s "
            f"({judged}); {what}; {len(waiting)} ranks wait for it" + _coverage_text(coverage)
        )
        evidence = HangEvidence(
            culprit=named_culprit,
            points_at=None if named_culprit else PointsAt(rank=rank, seen=False),
            kind=found["kind"],
            kind_waits_on=found["kind_waits_on"],
            waiting=waiting[:MAX_WAITING_LISTED],
            waiting_count=len(waiting),
            waits_on=found["waits_on"],
            missing=found["missing"],
            method=found["method"],
            stalled_seconds=round(stalled, 3),
            since_boundary_seconds=round(since, 3),
            busy=busy,
            stalled_since=self.progress.time,
            bound_seconds=round(bound, 3),
            median_step_seconds=self.progress.median_step_seconds(),
            last_step=self.progress.step,
            stale_ranks=stale,
            coverage=coverage,
            cpu_wait_seconds=None if cpu_wait is None or busy else round(cpu_wait, 3),
        )
        action = RuleAction.ALERT
        if self.settings.requeue and self.requeue is not None:
            action, note = self.requeue.verdict()
            reason += note
            evidence.requeue = self.requeue.evidence()
        record = self._record(BuiltinRule.HANG, reason, evidence, self.progress.step, action)
        record["step_at"] = self.progress.step
        return record

    def _echo_record(self, echoes: list[Activity], coverage: Coverage | None) -> dict:
        """rank-gone naming no culprit: ranks that ended of a peer's loss after the run's first failure."""
        cause = self.cause
        assert cause is not None  # check() asks only once a cause was named
        lost = [a.rank for a in echoes]
        reason = (
            f"rank-gone: ranks {lost[:MAX_WAITING_LISTED]} ended after losing a peer: echoes of rank "
            f"{cause.rank}'s failure, named before; no new culprit" + _coverage_text(coverage)
        )
        evidence = RankGoneEvidence(culprit=None, echo_of=cause.rank, gone=lost, coverage=coverage)
        self.gone_reported.update(lost)
        return self._record(BuiltinRule.RANK_GONE, reason, evidence, max(a.step for a in echoes))

    def _node_lost(
        self,
        rows: Mapping[int, Activity],
        rank: int,
        lost: list[NodeMissing],
        stalled: float,
        coverage: Coverage | None,
    ) -> dict:
        """rank-gone for a stall whose waits point at ranks of nodes gone quiet (ranks and sidecar silent: a
        node lost, stopped or cut off): those ranks are gone, no hang is named (DESIGN.md, faults told truly)."""
        unknown = sorted(r for r, a in rows.items() if a.state == RankState.UNKNOWN)
        reason = (
            f"rank-gone: node lost: the run stopped {stalled:.1f} s ago waiting for rank {rank}, and the leader has "
            f"heard nothing from its node since; ranks {unknown[:MAX_WAITING_LISTED]} are gone"
        ) + _coverage_text(coverage)
        evidence = RankGoneEvidence(
            culprit=None,
            cause="node-lost",
            points_at=PointsAt(rank=rank, seen=False),
            gone=unknown[:MAX_WAITING_LISTED],
            nodes_lost=lost[:MAX_LISTED],
            stalled_seconds=round(stalled, 3),
            stalled_since=self.progress.time,
            coverage=coverage,
        )
        self.gone_reported.update(unknown)
        self._lost_since = self.progress.time
        return self._record(BuiltinRule.RANK_GONE, reason, evidence, self.progress.step)

    def check_nodes(self, missing: list[NodeMissing], ranks_of: Callable[[str], list[int]]) -> list[dict]:
        """Once a second at the leader: a node missing (no digest for its grace) while the run crossed step
        boundaries after its last digest lost its sidecar, not its ranks (the boundary's all-reduce needs
        every rank): `sidecar-lost`, once per node until it is heard again."""
        gone_quiet = {m.node: m.since for m in missing}
        self._sidecars_lost &= gone_quiet.keys()  # a node heard again may be lost again later
        boundary = self.progress.time
        records = []
        for node, since in gone_quiet.items():
            if node in self._sidecars_lost or boundary is None or boundary <= since + CLOCK_SKEW_SECONDS:
                continue
            self._sidecars_lost.add(node)
            ranks = ranks_of(node)
            reason = (
                f"sidecar-lost: node {node} sent no digest since {since:.0f}, yet the run crossed step boundaries "
                f"after (step {self.progress.step}): its ranks {ranks[:MAX_WAITING_LISTED]} train on, unseen"
            )
            evidence = SidecarLostEvidence(
                node=node, silent_since=since, ranks=ranks[:MAX_WAITING_LISTED], last_step=self.progress.step
            )
            records.append(self._record(BuiltinRule.SIDECAR_LOST, reason, evidence, self.progress.step))
        return records

    def _unseen_cause(self, echoes: list[Activity], unseen: list[int], coverage: Coverage | None) -> dict:
        """rank-gone when the ranks that ended lost a peer (or ended without a word beside those that did)
        and some ranks are not seen (a node lost whole): the failure is among those; no culprit is named."""
        lost = [a.rank for a in echoes]
        reason = (
            f"rank-gone: ranks {lost[:MAX_WAITING_LISTED]} ended after a peer was lost and the leader has no current report "
            f"of ranks {unseen[:MAX_WAITING_LISTED]}: the first failure is among those" + _coverage_text(coverage)
        )
        evidence = RankGoneEvidence(
            culprit=None,
            points_at=PointsAt(rank=unseen[0], seen=False),
            gone=lost,
            unseen=unseen[:MAX_WAITING_LISTED],
            coverage=coverage,
        )
        self.gone_reported.update(lost)
        self.gone_reported.update(unseen)
        self._echoes_since = None
        return self._record(BuiltinRule.RANK_GONE, reason, evidence, max(a.step for a in echoes))

    def _record(
        self, rule: BuiltinRule, reason: str, evidence: Finding, step: int | None, action: RuleAction = RuleAction.ALERT
    ) -> dict:
        echo = isinstance(evidence, RankGoneEvidence) and isinstance(evidence.echo_of, int)
        record = dict(
            self.engine.record_finding(
                rule,
                action,
                reason,
                evidence,
                step if step is not None and step >= 0 else None,
                bundle=self.run_id if rule in EVIDENCE_RULES and not echo else None,
            )
        )
        self.findings.append(record)
        return record

    @property
    def hang_detected(self) -> bool:
        return self.hang is not None


class HangMetrics(Collector):
    """parwatch_hang_detected, fresh on every scrape (parwatch_rank_state{rank}: sidecar/rank_gauges.py).

    Registered on the sidecar's registry by parwatch.sidecar.activity_api.install."""

    def __init__(self, monitor_fn):
        self._monitor_fn = monitor_fn  # () -> HangMonitor at the leader, None elsewhere

    def collect(self):
        monitor = self._monitor_fn()
        if monitor is None:
            return
        detected = family(GaugeMetricFamily, "parwatch_hang_detected")
        detected.add_metric([], 1.0 if monitor.hang_detected else 0.0)
        yield detected
