"""Node digests: each node's sidecar keeps its ranks' live activity and forwards a compact digest of
it to the run's leader sidecar, so the leader sees every rank without every rank posting to it.

Who is the leader: the sidecar that receives rank 0's activity or summaries (it learns it from
them). The others learn the leader's URL from configuration: `parwatch sidecar --leader-url URL`
(Helm: the leader pod's stable DNS name through a headless Service). A sidecar without
--leader-url that is not the leader keeps its digests to itself (single-node runs need nothing).

Liveness is decided on the node, where it can be checked: a rank whose pid no longer exists on
this host is `gone` (a crash), with the moment it ended when its node saw it (parwatch.sidecar.exits);
one alive but silent for `silent_seconds` is `silent`; one that said it finished is `done`; one that
said it ended by an exception is `crashed`, with the exception. Activity keeps flowing from a hung
rank (its reporter thread is independent of the blocked training thread), so a hang reads as
`running` with the same span open.

The digest body and the activity report are typed records (parwatch/wire/activity.py), decoded with every
field checked; what depends on the run (a rank inside its layout) is checked here.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterator

from msgspec.structs import replace

from parwatch.rank_layout import DEFAULT_ORDER, LayoutError, RankLayout, cached_layout
from parwatch.sidecar.claims import CLOCK_SKEW_SECONDS
from parwatch.sidecar.cpu_wait import CpuWaits
from parwatch.sidecar.exits import ProcessExits
from parwatch.sidecar.hang import ENDED
from parwatch.sidecar.observations import rank_key
from parwatch.sidecar.pace import RunPace
from parwatch.vocabulary import RankState
from parwatch.wire.activity import Activity, NodeDigest
from parwatch.wire.bounds import MAX_STEPS_PER_SECOND, MAX_WORLD
from parwatch.wire.codec import BadRecord
from parwatch.wire.findings import NodeMissing


class BadActivity(BadRecord):
    """An activity report or digest does not fit its run; the message names the field."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


def layout_of(tp_pp_dp: tuple[int, int, int], order: str | None, where: str) -> RankLayout:
    """[tp, pp, dp] (each 1..MAX_WORLD by its type) and the order (None: the default) -> the run's
    layout, refused when tp*pp*dp > MAX_WORLD."""
    tp, pp, dp = tp_pp_dp
    if tp * pp * dp > MAX_WORLD:
        raise BadActivity(
            f"{where} {list(tp_pp_dp)} is a world of {tp * pp * dp} ranks, over the {MAX_WORLD} a sidecar accepts"
        )
    try:
        return cached_layout(tp, pp, dp, order or DEFAULT_ORDER)
    except LayoutError as err:
        raise BadActivity(f"{where}: {err}") from None


def in_layout(a: Activity, layout: RankLayout, where: str) -> Activity:
    """A decoded row checked against its run's layout: rank, coordinates and peer inside it, and agreeing."""
    for field, value, top in (
        ("rank", a.rank, layout.world - 1),
        ("stage", a.stage, layout.pp - 1),
        ("tp_rank", a.tp_rank, layout.tp - 1),
        ("dp_rank", a.dp_rank, layout.dp - 1),
        ("peer", a.peer or 0, layout.world - 1),
    ):
        if value > top:
            raise BadActivity(f"{where}.{field} must be an integer in 0..{top}, got {value}")
    wrong = layout.mismatch(a.rank, (a.tp_rank, a.stage, a.dp_rank))
    if wrong is not None:
        raise BadActivity(f"{where}: {wrong} ({layout})")
    return a


def digest_rows(rows: list[Activity], layout: RankLayout, latest: float = float("inf")) -> list[Activity]:
    """A digest's rows checked against its layout: at most its world, each inside it, each rank once, and
    none telling of a time after `latest` (the leader's clock and the clocks' skew)."""
    tp, pp, dp, world = layout.tp, layout.pp, layout.dp, layout.world
    st, sp, sd = layout.strides
    if len(rows) > world:
        raise BadActivity(f"digest.rows must be a list of at most {world} rows (the layout's world)")
    seen: set[int] = set()
    for i, a in enumerate(rows):  # one expression a row: the leader takes 2,048 digests a second
        if (
            a.stage >= pp
            or a.tp_rank >= tp
            or a.dp_rank >= dp
            or a.rank != a.tp_rank * st + a.stage * sp + a.dp_rank * sd
            or (a.peer is not None and a.peer >= world)
            or a.rank in seen
            or a.time > latest
            or (a.step_end is not None and a.step_end > latest)
            or (a.since is not None and a.since > latest)
            or (a.ended is not None and a.ended > latest)
        ):
            _refuse_row(a, layout, f"digest.rows[{i}]", latest)
        seen.add(a.rank)
    return rows


def check_times(a: Activity, where: str, latest: float) -> None:
    """A report was sampled, and its step ended, before it arrived (give or take the clocks' skew): a boundary
    in the future would stall every later real one behind it (a hang out of nothing)."""
    for name, value in (("time", a.time), ("step_end", a.step_end), ("since", a.since), ("ended", a.ended)):
        if value is not None and value > latest:
            raise BadActivity(
                f"{where}.{name}={value:.3f} is later than this sidecar's clock allows ({latest:.3f}): a report tells what already happened"
            )


def _refuse_row(a: Activity, layout: RankLayout, where: str, latest: float) -> None:
    in_layout(a, layout, where)
    check_times(a, where, latest)
    raise BadActivity(f"{where}: rank {a.rank} appears twice")


def same_layout(known: RankLayout | None, layout: RankLayout, where: str) -> None:
    if known is not None and known != layout:
        raise BadActivity(
            f"{where} ({layout}) differs from this run's ({known}), fixed when it was first seen; "
            "a run's layout cannot change (a new layout is a new run id)"
        )


class StepPace(RunPace):
    """A run's step pace as its ranks' activity tells it (pace.RunPace), refusing with BadActivity."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__(clock, MAX_STEPS_PER_SECOND)

    def check(self, run_id: str, step: int, where: str, rank: int) -> None:
        why = self.too_far(run_id, step, rank)
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
        exits: ProcessExits | None = None,
        cpu_waits: CpuWaits | None = None,
    ):
        self.clock = clock
        self.silent_seconds = silent_seconds
        self.hostname = hostname or socket.gethostname()
        self._alive = alive
        self.exits = exits
        """When this node's rank processes ended (None: the pid check alone)."""
        self.cpu_waits = cpu_waits if cpu_waits is not None else CpuWaits(clock)
        """How long this node's ranks waited for a CPU lately (their rows' cpu_wait)."""
        self.run_id: str | None = None
        self.layout: RankLayout | None = None
        self.latest: dict[int, tuple[Activity, float]] = {}
        """rank -> (activity, sidecar clock when it arrived)."""

    def add(self, a: Activity, layout: RankLayout, run_id: str) -> None:
        if run_id != self.run_id:
            self.latest = {}  # a new run: the old ranks are not this run's
            self.run_id = run_id
            self.layout = None
            if self.exits is not None:
                self.exits.forget()
            self.cpu_waits.forget()
        same_layout(self.layout, layout, "activity [tp, pp, dp]")
        self.layout = layout
        previous = self.latest.get(a.rank)
        self.latest[a.rank] = (a, self.clock())
        if self.exits is not None and a.host == self.hostname:
            if previous is not None and previous[0].pid != a.pid:
                self.exits.drop(previous[0].pid)
            if a.state == RankState.RUNNING:
                self.exits.watch(a.pid)

    def rows(self) -> dict[int, Activity]:
        """Every rank with its liveness judged now, and a running one of this host with its wait for a CPU."""
        now = self.clock()
        out = {}
        for rank, (a, seen) in list(self.latest.items()):
            state = a.state
            ended = None
            if state == RankState.RUNNING:
                local = a.host == self.hostname
                ended = self.exits.ended(a.pid) if local and self.exits is not None else None
                if local and (ended is not None or not self._alive(a.pid)):
                    state = RankState.GONE
                elif now - seen > self.silent_seconds:
                    state = RankState.SILENT if local else RankState.GONE  # another host's pid cannot be checked here
                if state != RankState.GONE and local and (waited := self.cpu_waits.waited(a)) is not None:
                    a = replace(a, cpu_wait=waited[0], span_cpu_wait=waited[1])  # alive: running, or silent (late)
            out[rank] = a if state == a.state else replace(a, state=state, ended=ended)
        return out

    def digest(self, node: str) -> NodeDigest | None:
        if self.layout is None:
            return None
        layout = self.layout
        return NodeDigest(
            1,
            node,
            self.run_id,
            self.clock(),
            (layout.tp, layout.pp, layout.dp),
            list(self.rows().values()),
            layout.order,
        )


class LeaderView:
    """At the leader: the latest digest of every node, merged into one picture of the run. A node
    whose digests stopped for `grace_seconds` is missing: its ranks read `unknown`, never `running`."""

    def __init__(self, clock: Callable[[], float], grace_seconds: float = 5.0, pace: StepPace | None = None):
        self.clock = clock
        self.grace_seconds = grace_seconds
        self.pace = pace or StepPace(clock)
        self.run_id: str | None = None
        self.layout: RankLayout | None = None
        self.nodes: dict[str, tuple[float, list]] = {}
        """node -> (leader clock at arrival, rows as sent)."""
        self.owner: dict[int, str] = {}
        """rank -> the node that reports it: another node's row for it is refused while that node is heard."""
        self.gone: set[int] = set()
        """Ranks the latest digests report gone: kept on ingest so the leader's once-a-second check
        need not look at every rank while none is."""
        self.up: dict[int, bool] = {}
        """rank -> up, kept on ingest for liveness(): the leader's once-a-second tick reads it whole."""
        self.up_series: dict[str, float] = {}
        """The same as the rank_up observation's series ("rank=N" -> 1.0 or 0.0), kept alongside."""
        self.running = 0
        """How many ranks `up` holds as up (kept with it): none running, the run has ended here."""
        self.last_heard = 0.0
        """When the newest digest of the run arrived (this clock)."""
        self._quiet: set[str] = set()  # nodes whose ranks liveness() marked down for silence

    def ingest(self, digest: NodeDigest) -> tuple[str, list[Activity], dict[int, str]]:
        """Store one digest; (node, its rows, the rows held back: {index: why}). A row ahead of the run is held
        alone, its rank's previous row kept: refusing the digest whole blinded the leader to the node's every
        rank, every second that row stayed its rank's latest. BadActivity names what does not fit the run."""
        node, layout = digest.node, layout_of(digest.layout, digest.order, "digest.layout")
        rows = digest_rows(digest.rows, layout, self.clock() + CLOCK_SKEW_SECONDS)
        run_id = digest.run_id or ""
        pace = self.pace
        high = pace.high if run_id == pace.run_id else None
        held: dict[int, str] = {}
        best = None  # the digest's furthest row: what the node tells of the run's pace
        for i, a in enumerate(rows):
            # A row no further than any rank reached needs no check.
            why = pace.too_far(run_id, a.step, a.rank) if high is not None and a.step > high else None
            if why is not None:
                held[i] = f"digest.rows[{i}].step{why}"
            elif best is None or a.step > best.step:
                best = a
        if held:
            if len(held) == len(rows):
                raise BadActivity(held[min(held)])
            before = {a.rank: a for a in self.nodes.get(node, (0.0, []))[1]} if run_id == self.run_id else {}
            rows = [
                a if i not in held else before[a.rank] for i, a in enumerate(rows) if i not in held or a.rank in before
            ]
        if run_id == self.run_id:
            same_layout(self.layout, layout, "digest.layout")
            self._check_owners(node, rows)
        else:
            self.nodes, self.gone, self.owner, self._quiet = {}, set(), {}, set()
            self.up, self.up_series, self.running = {}, {}, 0
            self.run_id = run_id
            self.layout = None
        if node not in self.nodes and len(self.nodes) >= layout.world:
            raise BadActivity(
                f"digest.node {node!r}: this run already has {len(self.nodes)} nodes, as many as its ranks"
            )
        self.layout = layout
        previous = self.nodes.get(node)
        self.nodes[node] = (now := self.clock(), rows)
        self.last_heard = now
        self._quiet.discard(node)
        gone, owner = self.gone, self.owner
        if best is not None:
            pace.note(run_id, best.step, best.rank, best.step_seconds)
        for a in rows:
            owner[a.rank] = node
            if a.state in ENDED:
                gone.add(a.rank)
            elif a.rank in gone:
                gone.discard(a.rank)
            self._set_up(a.rank, None if a.state == RankState.DONE else a.state == RankState.RUNNING)
        if previous is not None:  # a rank this node no longer reports (the same count can hide a swap)
            kept = {a.rank for a in rows}
            for a in previous[1]:
                if a.rank not in kept and owner.get(a.rank) == node:
                    self._set_up(a.rank, None)
        return node, rows, held

    def _set_up(self, rank: int, up: bool | None) -> None:
        """One rank's liveness in `up` and `up_series`; None: left out (done: its summaries tell)."""
        self.running -= self.up.get(rank, False)
        if up is None:
            self.up.pop(rank, None)
            self.up_series.pop(rank_key(rank), None)
        else:
            self.up[rank] = up
            self.running += up
            self.up_series[rank_key(rank)] = 1.0 if up else 0.0

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
        out: dict[int, Activity] = {}
        for _ in self.fill_rows(out):
            pass
        return out

    def fill_rows(self, out: dict[int, Activity], slice_ranks: int | None = None) -> Iterator[None]:
        """rows() into `out`, yielding after every `slice_ranks` ranks or so: the leader's loop answers posts
        between (at 16,384 ranks the whole took 5-7 ms at once). The nodes as they were at the first step."""
        now, taken = self.clock(), 0
        for seen, rows in list(self.nodes.values()):
            stale = now - seen > self.grace_seconds
            for a in rows:
                out[a.rank] = (
                    replace(a, state=RankState.UNKNOWN)
                    if stale and a.state in (RankState.RUNNING, RankState.SILENT)
                    else a
                )
            taken += len(rows)
            if slice_ranks is not None and taken >= slice_ranks:
                taken = 0
                yield

    def liveness(self) -> dict[int, bool]:
        """rank -> up, as rows() reads: running in its node's latest digest is up, any other state down,
        and so is every rank of a node gone quiet (unknown); a rank done is left out (its summaries tell).
        Kept as digests arrive: this call is O(nodes). The mapping is the view's own: do not change it."""
        oldest, up, owner = self.clock() - self.grace_seconds, self.up, self.owner
        for node, (seen, rows) in list(self.nodes.items()):
            if seen < oldest and node not in self._quiet:  # gone quiet since the last call: its ranks down
                self._quiet.add(node)
                for a in rows:
                    if a.rank in up and owner.get(a.rank) == node:
                        self._set_up(a.rank, False)
        return up

    def heard_since(self, since: float) -> bool:
        """Whether every node not yet missing has sent a digest at or after `since` (the leader's clock)."""
        oldest = self.clock() - self.grace_seconds
        return all(seen >= since for seen, _ in list(self.nodes.values()) if seen >= oldest)

    def ranks_of(self, node: str) -> list[int]:
        """The ranks a node's latest digest reported."""
        seen = self.nodes.get(node)
        return sorted(a.rank for a in seen[1]) if seen is not None else []

    def missing_nodes(self) -> list[NodeMissing]:
        """Nodes whose digests stopped (since: their last digest's arrival), oldest first."""
        now = self.clock()
        return sorted(
            (
                NodeMissing(node=n, since=round(seen, 3))
                for n, (seen, _) in self.nodes.items()
                if now - seen > self.grace_seconds
            ),
            key=lambda m: m.since,
        )
