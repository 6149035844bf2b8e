"""Waiting told apart from transfer: the node sidecar lines up the members of each collective
and p2p instance, and the straggler attribution that rests on it.

Each rank's summary carries `instances` (parwatch/collector/instances.py): per sampled step,
one record per collective or p2p instance with its group, sequence number and duration. An
instance is complete once every member's record is here: a collective group's members (its
`groups` entry), or a p2p pair (the send on src with peer dst, the recv on dst with peer src,
the same per-direction seq). Then, as DeepSpeed's comms logger defines the straggler effect:

    transfer = min over members of t           (the last arrival's duration: it did not wait)
    wait(r)  = t(r) - transfer                  (rank r's arrival wait; its straggler effect)

Durations only, no timestamps: nothing depends on the hosts' clocks agreeing. For p2p the
recv's duration runs from its post to the data; the send's, from its post to its completion
(stamped when it completes, parwatch/trainer/comm.py), so the recv's wait is its wait for the peer's
post and a slow link shows as a long transfer on both ends.

Where an instance is matched: on the node, when its members all report to this sidecar (TP
groups are on one node by construction; p2p pairs with both ends on this node). One with a
member on another node (cross-node p2p, DP groups across nodes) is matched at the run's leader
(the sidecar that receives rank 0's summaries):
- a node sidecar with --leader-url (`forwarding`) sets its halves of such instances aside, once
  a second, in a bounded outbox that its activity loop posts to the leader
  (parwatch/sidecar/crossnode.py), with its ranks' attribution figures; outbox overflow and
  failed posts count as reason="unsent";
- the leader (`leading`) merges forwarded halves with its own by the same key and finishes them
  exactly as local ones; an instance with a member on another node waits there up to
  `remote_seconds` (the forward path is about a second), then counts as reason="remote".
A sidecar that neither leads nor forwards drops instances with a remote member after
`horizon_steps` (reason="remote"). Members that did report here but whose partner's record was
lost count as reason="incomplete". Unmatched time stays in parwatch_collective_duration_seconds
(waiting included), without transfer, busbw or attribution figures. Every instance is finished
at exactly one sidecar, so summing a series over sidecars counts each instance once.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from parwatch.catalog import family
from parwatch.guardrails.attribution import (
    CAUSES,
    Finding,
    Paired,
    PathFigures,
    RankFigures,
    Thresholds,
    attribute,
    median_at,
    paired_excess,
)
from parwatch.guardrails.checks import RollingWindow
from parwatch.vocabulary import CollectiveOp, GroupRole
from parwatch.wire.steps import COLLECTIVE_BUCKETS, busbw_factor

HORIZON_STEPS = 8
"""An instance still incomplete this many steps after it was first seen is dropped as unmatched."""
MAX_PENDING = 50_000
"""Bound on incomplete instances held (the oldest go first, counted as unmatched)."""
REMOTE_SECONDS = 10.0
"""At the leader, an instance with a member on another node waits this long for the forwarded
half (the forward path takes one activity tick, about a second, plus the ranks' own post delay)."""
MAX_OUTBOX = 20_000
"""Bound on instances a forwarding node holds for the leader (ten posts' worth; the oldest go first,
counted as unmatched reason="unsent")."""
MAX_OUTBOX_RANK_ROWS = 4096
"""Bound on rank attribution rows a forwarding node holds for the leader (the oldest go first)."""
WINDOW_STEPS = 10
"""Steps of figures the attribution takes medians over."""
PAIRED_WINDOW_STEPS = 20
"""Steps over which each rank's own compute is compared with its stage peers', step by step (a 5% slower
rank within 20 steps: the median turns after 10, the rule's for_steps adds 5)."""
WARMUP_STEPS = 5
"""A run's first steps are not attributed: they pay one-time costs (allocator growth, the first
autograd graph, lazy initialisation, connection setup) unevenly across stages (measured: the last
stage 2x the first for steps 1-7 of a healthy synthetic run on a loaded machine)."""
MIN_WINDOW_STEPS = 5
"""A rank or path is judged only once it has this many steps of figures (a median of one or two
steps is one step's noise)."""
STARVED_FACTOR, STARVED_MIN_SHARE = 2.0, 0.05
"""A rank is starved while it waits for a CPU more than twice its calm median share of the step and 5 points
over it: its paths' transfers are then not judged against their own history (collective_transfer_seconds).
Under 40 busy loops beside the campaign's ref run, collective-latency-regression called a loopback link 3.95x
its median a degraded link (docs/benchmarks.md); its ranks' share waiting for a CPU had ~doubled."""
WAIT_BASELINE_STEPS = 50
"""A rank's calm wait share is its median over this many steps it was not starved (collective-latency-regression's
window); starved this long in a row, the host's new normal is taken as calm."""
BUSBW_INSTANCES = 256
"""Newest matched instances per (op, group) that busbw is computed over."""
COLLECTIVE_LE = [repr(float(b)) for b in COLLECTIVE_BUCKETS]


class Member(NamedTuple):
    op: str
    seconds: float
    bytes: int


class Pending(NamedTuple):
    op: str
    """The instance's op label: the collective's op, or "send" for a p2p transfer."""
    group: str
    path: tuple
    """("group", role, ranks) or ("link", src, dst): where the instance ran."""
    members: frozenset
    first_step: int
    got: dict
    """rank -> Member."""
    first_seen: float = 0.0
    """The tracker's clock when the first member arrived (the leader's time bound on remote halves)."""
    key: tuple = ()
    """("c", group, members in group order, seq) or ("p", src, dst, seq): one instance on every rank."""


class Split(NamedTuple):
    """One matched instance, split."""

    op: str
    group: str
    path: tuple
    transfer: float
    waits: dict
    """rank -> (op on that rank, wait seconds)."""
    last: int
    """The last arrival (the rank every other member waited for)."""
    bytes: int
    size: int


def path_key(path: tuple, op: str, group: str) -> str:
    """The guardrail series key of a path: op=send,group=pp,src=0,dst=2 / op=all_reduce,group=tp,ranks=0+1."""
    if path[0] == "link":
        return f"op={op},group={group},src={path[1]},dst={path[2]}"
    return f"op={op},group={group},ranks={'+'.join(map(str, path[2]))}"


class TransferView(NamedTuple):
    """What /metrics shows, as one immutable value (sorted tuples of (labels, values))."""

    histograms: tuple = ()
    """((op, group), (cumulative buckets, count, seconds sum))"""
    busbw: tuple = ()
    waits: tuple = ()
    unmatched: tuple = ()
    straggler: tuple = ()
    causes: tuple = ()
    """((cause, largest ratio among its findings; 0 when none)), once attribution has data."""


class _OpTotals:
    __slots__ = ("buckets", "count", "seconds", "wait", "bytes", "recent")

    def __init__(self):
        self.buckets = [0] * (len(COLLECTIVE_BUCKETS) + 1)
        """Instances per bucket (not cumulative: one increment per instance); the last is over every bound."""
        self.count, self.seconds, self.wait, self.bytes = 0, 0.0, 0.0, 0
        self.recent: deque = deque(maxlen=BUSBW_INSTANCES)


class TransferTracker:
    """Matches instances as summaries arrive (one writer: the sidecar's event loop)."""

    def __init__(
        self,
        horizon_steps: int = HORIZON_STEPS,
        max_pending: int = MAX_PENDING,
        window_steps: int = WINDOW_STEPS,
        thresholds: Thresholds = Thresholds(),
        remote_seconds: float = REMOTE_SECONDS,
        max_outbox: int = MAX_OUTBOX,
        clock=time.monotonic,
    ):
        self.horizon_steps, self.max_pending, self.window_steps = horizon_steps, max_pending, window_steps
        self.thresholds = thresholds
        self.remote_seconds, self.max_outbox, self.clock = remote_seconds, max_outbox, clock
        self.forwarding = False
        """This node hands instances with a remote member to the leader (set when --leader-url is)."""
        self._lock = threading.Lock()
        self._reset(None)

    def _reset(self, run_id) -> None:
        self.run_id = run_id
        self._view = TransferView()
        self._stale_view = False
        self.pending: dict[tuple, Pending] = {}
        self.outbox: dict[tuple, Pending] = {}
        """Forwarding node: instances for the leader, oldest first (crossnode.py posts them)."""
        self.outbox_ranks: deque = deque(maxlen=MAX_OUTBOX_RANK_ROWS)
        """Forwarding node: (rank, step, stage, host, compute, data, step, own compute, CPU wait seconds) rows for
        the leader."""
        self.leading = False
        """This sidecar receives rank 0's summaries: it matches what the nodes forward."""
        self.local_ranks: set[int] = set()
        self.newest_step = 0
        self.totals: dict[tuple[str, str], _OpTotals] = {}
        """(op, group) -> transfer histogram, wait, bytes (transfer under the instance's op; wait under
        each member's own op, so a recv's wait for its sender is (recv, pp))."""
        self._path_names: dict[tuple, str] = {}  # (path, op) -> path_key: one string per path, not per instance
        self.straggler: dict[int, float] = {}
        """rank -> sum of t - min t over its matched instances."""
        self.unmatched: dict[tuple[str, str, str], int] = {}
        """(op, group, reason) -> instances dropped unmatched."""
        self.sizes: dict[tuple[str, str], int] = {}
        # path key -> [transfer sum, count, members] matched since the last observation
        self._fresh: dict[str, list] = {}
        self._waits: dict[int, _CalmWait] = {}
        self.starved: set[int] = set()
        """Ranks now waiting for a CPU well beyond their calm share (STARVED_FACTOR)."""
        self._ranks: dict[int, deque] = {}  # rank -> (step, stage, host, compute, data, step, own compute, CPU wait)
        self._own: dict[int, deque] = {}  # rank -> (step, own compute) of its last PAIRED_WINDOW_STEPS
        self._paths: dict[tuple, deque] = {}  # path -> (step, transfer seconds summed over the step, instances)
        self._path_step: dict[tuple, list] = {}  # path -> [step, sum, count] being accumulated
        # The attribution's inputs, kept as rows arrive (a rank's once per summary, a path's once per
        # step) rather than all computed at once when rank 0's summary is evaluated.
        self._rank_figures: dict[int, RankFigures] = {}
        self._path_figures: dict[tuple, PathFigures] = {}
        self._rank_order: list[int] = []  # their keys sorted (keys are only ever added, until a reset)
        self._path_order: list[tuple] = []

    # -- intake ---------------------------------------------------------------------------------
    def add(self, s, cpu_wait: float | None = None) -> list[Split]:
        """Take one new summary (a parwatch.wire.steps.StepSummary) and its rank's wait for a CPU per second
        lately, where its node reads it; returns the instances it completed."""
        with self._lock:  # a scrape on another thread may be building the view
            return self._add(s, cpu_wait)

    def _add(self, s, cpu_wait: float | None) -> list[Split]:
        if s.run_id != self.run_id:
            self._reset(s.run_id)
        inst = s.instances
        self.local_ranks.add(s.rank)
        if s.rank == 0 and not self.leading:
            self._lead()
        new_step = s.step > self.newest_step
        if new_step:
            self.newest_step = s.step
        if inst is None:
            return []
        if s.step > WARMUP_STEPS:
            waited = None if cpu_wait is None else cpu_wait * s.step_seconds
            row = (
                s.step,
                s.stage,
                inst.host,
                s.compute_seconds,
                inst.data_seconds,
                s.step_seconds,
                _own_compute(s),
                waited,
            )
            self._add_rank_row(s.rank, row)
            if self.forwarding and not self.leading:
                self.outbox_ranks.append((s.rank, *row))
        done = []
        # group -> (members, member set, path), once per summary, not once per record
        groups: dict[str, tuple[tuple[int, ...], frozenset[int], tuple[str, str, tuple[int, ...]]]] = {}
        rank, step, pending, outbox = s.rank, s.step, self.pending, self.outbox
        for op, group, seq, peer, _start_us, dur_us, nbytes in inst.records:
            if peer < 0:
                found = groups.get(group)
                if found is None:
                    ranks = inst.groups.get(group)
                    if not ranks or rank not in ranks:
                        continue
                    members = tuple(ranks)
                    found = groups[group] = (members, frozenset(members), ("group", group, members))
                members, member_set, path = found
                key = ("c", group, members, seq)
                label = op
            else:
                src, dst = (rank, peer) if op == CollectiveOp.SEND else (peer, rank)
                key = ("p", src, dst, seq)
                member_set = None
                path, label = ("link", src, dst), CollectiveOp.SEND
            entry = pending.get(key)
            is_pending = entry is not None
            if entry is None:
                entry = outbox.get(key)  # set aside for the leader, not posted yet
                if entry is None:
                    if member_set is None:
                        member_set = frozenset((src, dst))
                    entry = self._pending_entry(Pending(label, group, path, member_set, step, {}, self.clock(), key))
                    is_pending = pending.get(key) is entry
            got = entry.got
            if rank in got:
                continue
            got[rank] = Member(op, dur_us * 1e-6, nbytes)
            if len(got) == len(entry.members) and is_pending:
                del pending[key]
                done.append(self._finish(entry))
        # Expiry scans every pending instance: once per new step, not once per summary.
        dropped = self._expire() if new_step else 0
        if done or dropped:
            self._stale_view = True
        return done

    def _pending_entry(self, entry: Pending) -> Pending:
        if len(self.pending) >= self.max_pending:
            self._drop(next(iter(self.pending)))
        self.pending[entry.key] = entry
        return entry

    def _outbox_entry(self, entry: Pending) -> Pending:
        if len(self.outbox) >= self.max_outbox:
            self._unsent(self.outbox.pop(next(iter(self.outbox))))
        self.outbox[entry.key] = entry
        return entry

    # -- across nodes (parwatch/sidecar/crossnode.py carries these) ------------------------------
    # Public methods take the lock: a scrape on another thread may be building the view.
    def lead(self) -> None:
        """This sidecar is the run's leader: match forwarded halves; keep what it had set aside."""
        with self._lock:
            self._lead()

    def _lead(self) -> None:
        self.leading = True
        held, self.outbox = list(self.outbox.values()), {}
        self.outbox_ranks.clear()
        self._merge(held, [])

    def _set_aside(self) -> None:
        """Forwarding node, once a tick: move pending instances with a member that does not report
        here to the outbox. Judged then, not on arrival: by then every local rank has reported (at
        start-up a TP peer's first summary may come a moment after its partner's)."""
        local = self.local_ranks
        remote = [k for k, e in self.pending.items() if not local.issuperset(e.members)]
        for key in remote:
            self._outbox_entry(self.pending.pop(key))

    def take_outbox(self, limit: int, max_members: int | None = None) -> tuple[list[Pending], list[tuple]]:
        """Up to `limit` of the oldest instances for the leader (and members listed in all, so a post of
        wide DP groups stays small), and every rank row held."""
        with self._lock:
            return self._take_outbox(limit, max_members)

    def _take_outbox(self, limit: int, max_members: int | None) -> tuple[list[Pending], list[tuple]]:
        self._set_aside()
        out: list[Pending] = []
        listed = 0
        for key in list(self.outbox)[:limit]:
            listed += len(self.outbox[key].members)
            if out and max_members is not None and listed > max_members:
                break
            out.append(self.outbox.pop(key))
        rows = list(self.outbox_ranks)
        self.outbox_ranks.clear()
        self._stale_view = True  # set-aside overflow may have counted unsent
        return out, rows

    def count_unsent(self, entries) -> None:
        """Instances this node could not hand to the leader (outbox full, post failed)."""
        with self._lock:
            for e in entries:
                self._unsent(e)
            self._stale_view = True

    def _unsent(self, e: Pending) -> None:
        k = (e.op, e.group, "unsent")
        self.unmatched[k] = self.unmatched.get(k, 0) + 1

    def merge(self, entries, rank_rows) -> int:
        """At the leader: another node's halves (Pending, any `first_seen`) and its ranks' attribution
        rows (as outbox_ranks'). Returns the instances completed."""
        with self._lock:
            return self._merge(entries, rank_rows)

    def _merge(self, entries, rank_rows) -> int:
        done, now = 0, self.clock()
        for e in entries:
            entry = self.pending.get(e.key)
            if entry is None:
                entry = self._pending_entry(e._replace(got={}, first_seen=now))
            for rank, m in e.got.items():
                entry.got.setdefault(rank, m)
            if len(entry.got) == len(entry.members):
                del self.pending[e.key]
                self._finish(entry)
                done += 1
        for rank, *row in rank_rows:
            if rank not in self.local_ranks and row[0] > WARMUP_STEPS:
                self._add_rank_row(rank, tuple(row))
        self._stale_view = True
        return done

    @property
    def view(self) -> TransferView:
        """The figures /metrics shows, as one immutable value (see transfer_families). Rebuilt when
        read after a change, not after every summary: a scrape every 15 s reads it, 1024 posts/s change it."""
        if self._stale_view:
            with self._lock:
                self._stale_view = False
                self._view = self._build_view()
        return self._view

    def _build_view(self) -> TransferView:
        hist, busbw, waits = [], [], []
        for key, tot in sorted(self.totals.items()):
            if tot.count:
                hist.append((key, (tuple(accumulate(tot.buckets[:-1])), tot.count, tot.seconds)))
                moved, spent = sum(b for b, _ in tot.recent), sum(t for _, t in tot.recent)
                if spent > 0:
                    busbw.append((key, moved / spent * busbw_factor(key[0], self.sizes.get(key, 2))))
            waits.append((key, tot.wait))
        return TransferView(
            tuple(hist),
            tuple(busbw),
            tuple(waits),
            tuple(sorted(self.unmatched.items())),
            tuple(sorted(self.straggler.items())),
            self._view.causes,
        )

    def _finish(self, e: Pending) -> Split:
        # Called ~4 times per summary at 1024 ranks: the definition (split_instance in
        # tests/unit/test_transfer.py) written out, two passes over the members, no dicts built on the way.
        got = e.got
        transfer, last = math.inf, -1
        for rank, m in got.items():  # the last arrival: the shortest duration, the lowest rank among equals
            t = m.seconds
            if t < transfer or (t == transfer and rank < last):
                transfer, last = t, rank
        straggler, member_waits, nbytes = self.straggler, {}, 0
        group, label = e.group, e.op
        # Waits summed under each member's own op: one for a collective, send/recv for p2p.
        waited = 0.0
        other_ops: dict[str, float] | None = None
        for rank, (op, t, b) in got.items():
            wait = t - transfer
            member_waits[rank] = (op, wait)
            straggler[rank] = straggler.get(rank, 0.0) + wait
            if op == label:
                waited += wait
            else:
                other_ops = other_ops or {}
                other_ops[op] = other_ops.get(op, 0.0) + wait
            if b > nbytes:
                nbytes = b
        split = Split(label, group, e.path, transfer, member_waits, last, nbytes, len(e.members))
        tot = self._totals(label, group)
        tot.wait += waited
        for op, wait in (other_ops or {}).items():
            self._totals(op, group).wait += wait
        tot.count += 1
        tot.seconds += transfer
        tot.bytes += nbytes
        tot.recent.append((nbytes, transfer))
        tot.buckets[bisect_left(COLLECTIVE_BUCKETS, transfer)] += 1  # le semantics, as the duration histogram
        self.sizes[(label, group)] = len(e.members)
        name = self._path_names.get((e.path, label))
        if name is None:
            name = self._path_names[(e.path, label)] = path_key(e.path, label, group)
        fresh = self._fresh.get(name)
        if fresh is None:
            fresh = self._fresh[name] = [0.0, 0, e.members]
        fresh[0] += transfer  # a sum and a count: a node that never evaluates must not grow a list
        fresh[1] += 1
        step = e.first_step
        if step <= WARMUP_STEPS:
            return split
        acc = self._path_step.get(e.path)
        if acc is None or acc[0] != step:
            if acc is not None:
                self._add_path_row(e.path, tuple(acc))
            acc = self._path_step[e.path] = [step, 0.0, 0]
        acc[1] += transfer
        acc[2] += 1
        return split

    def _totals(self, op: str, group: str) -> _OpTotals:
        tot = self.totals.get((op, group))
        if tot is None:
            tot = self.totals[(op, group)] = _OpTotals()
        return tot

    def tick(self) -> None:
        """Once a second (the activity loop): expire by time too, also once no summary arrives any more."""
        with self._lock:
            if self._expire():
                self._stale_view = True

    def _expire(self) -> int:
        """Drop what waited too long: by steps, or at the leader by time when a member is remote."""
        now = self.clock()
        limit = self.newest_step - self.horizon_steps
        local, stale = self.local_ranks, []
        for k, e in self.pending.items():
            if e.first_step >= limit:
                continue
            if not local.issuperset(e.members):
                if self.leading and now - e.first_seen <= self.remote_seconds:
                    continue  # the other node's half is on its way
                if self.forwarding and not self.leading:
                    continue  # the next tick sets it aside for the leader
            stale.append(k)
        for key in stale:
            self._drop(key)
        return len(stale)

    def _drop(self, key) -> None:
        e = self.pending.pop(key)
        reason = "remote" if not e.members <= self.local_ranks else "incomplete"
        k = (e.op, e.group, reason)
        self.unmatched[k] = self.unmatched.get(k, 0) + 1

    # -- guardrail series ---------------------------------------------------------------------
    def take_series(self) -> dict[str, dict[str, float]]:
        """The observation's series from this tracker; call once per evaluated step.

        collective_transfer_seconds: mean transfer per instance of each path, over the instances
        matched since the previous call (absent when none were: the rule then does not judge).
        straggler_ratio: the attribution's findings (cause and place in the key, share of the
        step as value); {"": 0.0} when the window is healthy; absent before any instance data.
        """
        out = {}
        fresh, self._fresh = self._fresh, {}
        if fresh:  # a starved rank's paths are slower with no link slow: not judged against their history meanwhile
            starved = self.starved
            out["collective_transfer_seconds"] = {
                k: total / n for k, (total, n, members) in fresh.items() if not (starved and starved & members)
            }
        if self._ranks:
            findings = self.findings()
            out["straggler_ratio"] = {f.key: f.ratio for f in findings} if findings else {"": 0.0}
            causes = tuple((c, max((f.ratio for f in findings if f.cause == c), default=0.0)) for c in CAUSES)
            self._view = self.view._replace(causes=causes)
        return out

    def findings(self) -> list[Finding]:
        return attribute(self.rank_figures(), self.path_figures(), self.thresholds, self.paired())

    def paired(self) -> dict[int, Paired]:
        """Each rank's own compute against its stage peers', step by step over PAIRED_WINDOW_STEPS."""
        own = {rank: dict(steps) for rank, steps in self._own.items() if steps}
        return paired_excess(own, {rank: self._ranks[rank][-1][1] for rank in own})

    def rank_figures(self) -> list[RankFigures]:
        figures = self._rank_figures
        if len(self._rank_order) != len(figures):  # sorted again only when a rank or path is new
            self._rank_order = sorted(figures)
        return [figures[r] for r in self._rank_order]

    def path_figures(self) -> list[PathFigures]:
        figures = self._path_figures
        if len(self._path_order) != len(figures):
            self._path_order = sorted(figures, key=repr)  # links and groups do not compare: by their text
        return [figures[p] for p in self._path_order]

    def _add_rank_row(self, rank: int, row: tuple) -> None:
        rows = self._ranks.setdefault(rank, deque(maxlen=self.window_steps))
        rows.append(row)
        cpu_wait, step_seconds = row[7], row[5]
        if (
            cpu_wait is not None
            and step_seconds > 0
            and self._waits.setdefault(rank, _CalmWait()).starved(cpu_wait / step_seconds)
        ):
            self.starved.add(rank)
        else:
            self.starved.discard(rank)
        if row[6] is not None:
            self._own.setdefault(rank, deque(maxlen=PAIRED_WINDOW_STEPS)).append((row[0], row[6]))
        if len(rows) >= min(MIN_WINDOW_STEPS, self.window_steps):
            _, stage, host, *_ = row
            compute, data, period = (_median([r[k] for r in rows]) for k in (3, 4, 5))
            own = [r[6] for r in rows if r[6] is not None]
            waited = [r[7] for r in rows if r[7] is not None]
            self._rank_figures[rank] = RankFigures(
                rank,
                stage,
                host,
                compute,
                data,
                period,
                _median(own) if len(own) == len(rows) else None,
                _median(waited) if len(waited) == len(rows) else None,
            )

    def _add_path_row(self, path: tuple, row: tuple) -> None:
        rows = self._paths.setdefault(path, deque(maxlen=self.window_steps))
        rows.append(row)
        if len(rows) >= min(MIN_WINDOW_STEPS, self.window_steps):
            _, values, counts = zip(*rows)
            value, count = _median(values), _median(counts)
            if path[0] == "link":
                self._path_figures[path] = PathFigures("link", "pp", (path[1], path[2]), value, count)
            else:
                self._path_figures[path] = PathFigures("group", path[1], tuple(path[2]), value, count)


class _CalmWait:
    """One rank's share of the step spent waiting for a CPU: its calm median, and whether it is starved now."""

    __slots__ = ("calm", "recent", "run")

    def __init__(self):
        self.calm = RollingWindow(WAIT_BASELINE_STEPS)  # sorted as it arrives: a median per summary is a lookup
        self.recent: deque = deque(maxlen=WAIT_BASELINE_STEPS)
        self.run = 0

    def starved(self, share: float) -> bool:
        self.recent.append(share)
        if len(self.calm) >= MIN_WINDOW_STEPS:
            base = self.calm.median()
            if share > max(STARVED_FACTOR * base, base + STARVED_MIN_SHARE):
                self.run += 1
                if self.run < WAIT_BASELINE_STEPS:
                    return True
                self.calm.extend(self.recent)  # starved as long as the baseline reaches back: the new normal
                self.run = 0
                return False
        self.run = 0
        self.calm.append(share)
        return False


def _own_compute(s) -> float | None:
    """Compute seconds less the rank's own TP collectives (nested in its forward and backward): None when its
    records were capped (their sum would fall short)."""
    inst = s.instances
    if inst is None or inst.capped:
        return None
    tp = sum(r[5] for r in inst.records if r[1] == GroupRole.TP) * 1e-6
    return max(s.compute_seconds - tp, 0.0)


def _median(values) -> float:
    """statistics.median of a short window, without its generality (called per summary)."""
    ordered = sorted(values)
    return median_at(len(ordered), ordered.__getitem__)


def transfer_families(tracker: TransferTracker):
    """The /metrics families of the wait/transfer split (the sidecar's exporter yields these).

    Reads only `tracker.view`, an immutable value built whole between ingests, so a scrape
    interleaved with ingests never sees half an update (as store.py)."""
    view = tracker.view
    hist = family(HistogramMetricFamily, "parwatch_collective_transfer_seconds")
    wait = family(CounterMetricFamily, "parwatch_collective_wait_seconds_total")
    busbw = family(GaugeMetricFamily, "parwatch_collective_busbw_bytes_per_second")
    unmatched = family(CounterMetricFamily, "parwatch_collective_unmatched_total")
    straggler = family(CounterMetricFamily, "parwatch_rank_straggler_seconds_total")
    for rank, seconds in view.straggler:
        straggler.add_metric([str(rank)], seconds)
    causes = family(GaugeMetricFamily, "parwatch_straggler_ratio")
    for (op, group), (buckets, count, seconds) in view.histograms:
        hist.add_metric([op, group], [*zip(COLLECTIVE_LE, buckets), ("+Inf", count)], seconds)
    for (op, group), value in view.busbw:
        busbw.add_metric([op, group], value)
    for (op, group), seconds in view.waits:
        wait.add_metric([op, group], seconds)
    for (op, group, reason), n in view.unmatched:
        unmatched.add_metric([op, group, reason], n)
    for cause, ratio in view.causes:
        causes.add_metric([cause], ratio)
    yield from (hist, wait, busbw, unmatched, straggler, causes)
