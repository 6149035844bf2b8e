"""Straggler attribution: which part of the run is slow, and why. Pure classification.

Input: per-rank figures (median per step over a recent window: compute, data fetch, step
period, host, stage) and per-path transfer figures (median transfer seconds per step of each
p2p link and each collective group, from the sidecar's wait/transfer split, so waiting for a
slow peer never counts as a slow transfer). Every figure is judged against its peers in the
same window (leave-one-out median), so a slowdown that hits the whole run alike is no
straggler, and no history is needed.

Causes, in the order they are decided (a rank explained by an earlier cause is not blamed
again by a later one):
  slow-data         a rank's data-fetch spans are high against the other fetching ranks
  host-contention   every rank of one host computes slower than its peers elsewhere AND the
                    transfers within that host are slower than the same groups elsewhere
  slow-compute      a stage's compute is high against the other stages (and, where own compute is
                    known, its slowest rank's own compute too: not only its TP waits), or some ranks'
                    compute against the rest of their stage
  slow-link         a p2p link's or a collective group's transfer is high against the other
                    links / groups of the same role, while its ranks' compute is normal, by more than
                    its ranks waited for a CPU beyond the other paths' ranks (a starved rank's
                    collectives are slow with no link slow: CI on e2beeaa named a TP group so)
A finding is kept when its excess is above both `min_seconds` per step and `rel` (compute) or
`rel_small` (data, transfers) x the peers' median, and costs at least `min_ratio` (10%) of the step.

One rank slower than the others of its stage (a throttled GPU, one slow TP rank) is judged step by step
(`paired_excess`): each step, its own compute (forward and backward less its TP collectives, whose
waits are its peers' time, not its own) less the median of its stage peers' own compute that same step;
over its last 20 steps, the median of those differences against their noise (1.4826 x their median
absolute deviation, pooled over the stage: MAD, robust to the odd descheduled step). A rank is slow when that median is above
`paired_z` standard errors of a median (1.2533 MAD / sqrt(n)), `paired_rel` of its peers' compute
and `paired_min_seconds`, and kept from `paired_min_ratio` (2%) of the step: a 5% slower rank is found,
the scheduling noise of a shared host is not.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from dataclasses import dataclass, field

CAUSES = ("slow-data", "host-contention", "slow-compute", "slow-link")


@dataclass(frozen=True)
class RankFigures:
    rank: int
    stage: int
    host: str
    compute_seconds: float
    """Forward + backward seconds per step."""
    data_seconds: float
    """Data-fetch seconds per step."""
    step_seconds: float
    own_compute_seconds: float | None = None
    """Compute less the rank's own TP collectives nested in it (their waits for a slow peer included): what
    it computed itself. A slow TP rank makes its whole stage slow (its peers wait inside their compute);
    this figure tells which one it is. None when its summaries carry no instance records."""
    cpu_wait_seconds: float | None = None
    """Seconds per step its threads waited for a CPU (runnable, not running: the node reads the kernel's count,
    sidecar/cpu_wait.py); None where the node cannot read it."""


@dataclass(frozen=True)
class PathFigures:
    kind: str
    """"link" (p2p, ranks = (src, dst)) or "group" (a collective group, ranks = its members)."""
    group: str
    """Group role: "pp" for links, "tp"/"dp"/... for collective groups."""
    ranks: tuple
    transfer_seconds: float
    """Transfer seconds per step (waiting excluded)."""
    count: float = 1.0
    """Instances per step (median): the noise floor scales with it."""


@dataclass(frozen=True)
class Thresholds:
    rel: float = 0.25
    """Compute: excess over the peers' median, relative to it (0.25: as the stage-skew rule's 1.25)."""
    rel_small: float = 0.5
    """Data fetch and transfers: the same, for figures a few ms long that scheduling noise moves by
    tens of percent in a healthy run (docs/benchmarks.md, "Straggler attribution's noise floor")."""
    min_seconds: float = 0.005
    """Excess per step below this is noise (timer, loopback and scheduling jitter)."""
    min_seconds_per_transfer: float = 0.002
    """Transfers: excess per instance below this is noise. 2 ms is above what a CPU run's scheduler
    and Python's 5 ms GIL switch interval add to one send or all-reduce on a loaded machine; lower
    it on GPU clusters to catch small per-op regressions (the
    collective-latency-regression rule judges each path against its own history meanwhile)."""
    min_ratio: float = 0.10
    """Findings of window medians (data, host, a stage, a link or group) costing less than this share of the
    step are dropped: their margins above are set against the noise of medians, not measured against it,
    and a few percent of a loaded machine's step moves them (the straggler rule fired at this until issue 44)."""
    paired_min_ratio: float = 0.02
    """One rank against its stage peers, step by step (paired_excess): its significance is tested, so findings
    down to this share of the step are kept (a 5% slower rank costs 3-8% of the step)."""
    paired_z: float = 4.0
    """A rank's paired excess must be this many standard errors above zero (paired_excess)."""
    paired_rel: float = 0.03
    """... and this share of its peers' own compute: a 5% slower rank is found, a persistent 1-2% difference
    between ranks (which one waits in the TP all-reduces, cache luck) is not named."""
    paired_min_seconds: float = 0.001
    """... and this many seconds per step (the timer's and the scheduler's floor)."""
    paired_min_steps: int = 10
    """Steps of paired figures needed before a rank is judged this way."""


@dataclass(frozen=True)
class Finding:
    cause: str
    where: dict = field(default_factory=dict)
    """stage / rank / host / src, dst / group, ranks: the place, in the series key's terms."""
    excess_seconds: float = 0.0
    """Seconds per step above the peers' median."""
    ratio: float = 0.0
    """excess_seconds / step_seconds."""
    text: str = ""

    @property
    def key(self) -> str:
        """The guardrail series key: "cause=slow-link,src=0,dst=2" (ranks joined by '+')."""
        parts = [f"cause={self.cause}"]
        for name, value in self.where.items():
            if isinstance(value, (tuple, list)):
                value = "+".join(str(v) for v in value)
            parts.append(f"{name}={value}")
        return ",".join(parts)


def _stands_out(
    value: float, base: float, th: Thresholds, small: bool = False, floor: float = 0.0
) -> tuple[float, float] | None:
    """(excess, baseline) when value stands out from its peers' median `base`, else None
    (small: data/transfer)."""
    excess = value - base
    if excess > max(th.min_seconds, floor, (th.rel_small if small else th.rel) * base):
        return excess, base
    return None


@dataclass(frozen=True)
class Paired:
    """One rank's own compute against its stage peers', step by step (paired_excess)."""

    excess: float
    """Median over the window of (its own compute - its peers' median own compute), seconds per step."""
    base: float
    """Median of its peers' own compute, seconds per step."""
    noise: float
    """Standard error of that median: 1.2533 x 1.4826 x MAD / sqrt(steps), the MAD pooled over the stage."""
    steps: int


def paired_excess(own: dict[int, dict[int, float]], stage_of: dict[int, int]) -> dict[int, Paired]:
    """rank -> Paired, from each rank's own compute per step ({rank: {step: seconds}}) against the other
    ranks of its stage that reported the same step. The noise is pooled over the stage (every rank's
    deviations from its own median difference): one rank's few steps would estimate it badly.
    O(ranks x steps x log(stage size))."""
    by_stage: dict[int, list[int]] = {}
    for rank in own:
        by_stage.setdefault(stage_of[rank], []).append(rank)
    out: dict[int, Paired] = {}
    for ranks in by_stage.values():
        if len(ranks) < 2:
            continue  # alone in its stage: no peer does the same work
        steps: dict[int, list[float]] = {}
        for r in ranks:
            for step, x in own[r].items():
                steps.setdefault(step, []).append(x)
        ordered = {step: sorted(xs) for step, xs in steps.items() if len(xs) >= 2}
        figures: dict[int, tuple[list[float], list[float]]] = {}
        deviations: list[float] = []
        for r in ranks:
            diffs, bases = [], []
            for step, x in own[r].items():
                values = ordered.get(step)
                base = median_without(values, [x]) if values is not None else None
                if base is not None:
                    diffs.append(x - base)
                    bases.append(base)
            if diffs:
                m = statistics.median(diffs)
                deviations += [abs(d - m) for d in diffs]
                figures[r] = (diffs, bases)
        sigma = 1.4826 * statistics.median(deviations) if deviations else 0.0
        for r, (diffs, bases) in figures.items():
            n = len(diffs)
            out[r] = Paired(statistics.median(diffs), statistics.median(bases), 1.2533 * sigma / n**0.5, n)
    return out


def _paired_slow(p: Paired | None, th: Thresholds) -> bool:
    return (
        p is not None
        and p.steps >= th.paired_min_steps
        and p.excess > max(th.paired_z * p.noise, th.paired_rel * p.base, th.paired_min_seconds)
    )


def _excess(
    value: float, peers: list[float], th: Thresholds, small: bool = False, floor: float = 0.0
) -> tuple[float, float] | None:
    """_stands_out against the median of `peers` (0 when there are none)."""
    return _stands_out(value, statistics.median(peers) if peers else 0.0, th, small, floor)


def median_at(n: int, at) -> float:
    """The median of n sorted values, element j being at(j): the one formula every median here uses."""
    half = n // 2
    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2


def _slowest_own_compute(stage: list[RankFigures], th: Thresholds) -> tuple[int, tuple[float, float]] | None:
    """(rank, (excess, base)) of the one rank of a slow stage whose own compute stands out from its stage
    peers' (leave-one-out median); None when none does, or more than one does (the stage as a whole is slow)."""
    own = [r for r in stage if r.own_compute_seconds is not None]
    if len(own) < 2 or len(own) < len(stage):
        return None
    bases = leave_one_out_medians([r.own_compute_seconds or 0.0 for r in own])
    hits = [
        (r.rank, hit)
        for r, base in zip(own, bases)
        if (hit := _stands_out(r.own_compute_seconds or 0.0, base, th)) is not None
    ]
    return hits[0] if len(hits) == 1 else None


def leave_one_out_medians(values: list[float]) -> list[float]:
    """[median of values without values[i] for each i] in O(n log n), not O(n^2): at 1024 ranks a
    sidecar compares every rank with all its peers once per step (0 when no peer is left)."""
    n = len(values)
    if n < 2:
        return [0.0] * n
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[i] for i in order]
    # Element j of the rest is ranked[j] if j < pos else ranked[j + 1] (pos: the position removed), so
    # the median of the rest is one of three values, chosen by where pos lies against the middle.
    m = n - 1
    half = m // 2
    if m % 2:  # median_at(m, at) = at(half)
        below, at_half, above = ranked[half + 1], ranked[half + 1], ranked[half]
    else:  # median_at(m, at) = (at(half - 1) + at(half)) / 2
        below = (ranked[half] + ranked[half + 1]) / 2
        at_half = (ranked[half - 1] + ranked[half + 1]) / 2
        above = (ranked[half - 1] + ranked[half]) / 2
    out = [0.0] * n
    for pos, i in enumerate(order):
        out[i] = below if pos < half else (at_half if pos == half else above)
    return out


def median_without(ordered: list[float], removed: list[float]) -> float | None:
    """The median of sorted `ordered` with one occurrence of each value in `removed` (all present)
    taken out, in O(k log n) for k removed; None when nothing is left."""
    positions, last, taken = [], None, 0
    for v in sorted(removed):  # equal values take successive positions
        taken = taken + 1 if v == last else 0
        last = v
        positions.append(bisect_left(ordered, v) + taken)
    n = len(ordered) - len(positions)
    if n <= 0:
        return None

    def at(j: int) -> float:  # the j-th of what is left
        for p in positions:
            if p > j:
                break
            j += 1
        return ordered[j]

    return median_at(n, at)


def _host_contention(ranks, paths, host_of, th, explained, keep) -> None:
    """Per host: all its ranks' compute high against the same stage elsewhere AND its inside
    transfers high against the same groups elsewhere. Each host is compared with the run minus
    that host (median_without over lists sorted once), so the cost grows as n log n with ranks
    and paths, not hosts x ranks (a leader sees thousands of hosts)."""
    by_host: dict[str, list[RankFigures]] = {}
    by_stage: dict[int, list[float]] = {}
    for r in ranks:
        by_host.setdefault(r.host, []).append(r)
        by_stage.setdefault(r.stage, []).append(r.compute_seconds)
    stage_sorted = {s: sorted(v) for s, v in by_stage.items()}
    all_sorted = sorted(r.compute_seconds for r in ranks)
    # Paths whose hosts are all known: "elsewhere" for every host they do not touch.
    by_group: dict[str, list[float]] = {}
    inside: dict[str, list[PathFigures]] = {}
    touching: dict[str, dict[str, list[float]]] = {}  # host -> group -> transfers of known paths touching it
    for p in paths:
        hs = {host_of.get(x) for x in p.ranks}
        if len(hs) == 1 and None not in hs:
            inside.setdefault(next(iter(hs)), []).append(p)
        if None in hs:
            continue
        by_group.setdefault(p.group, []).append(p.transfer_seconds)
        for h in hs:
            touching.setdefault(h, {}).setdefault(p.group, []).append(p.transfer_seconds)
    group_sorted = {g: sorted(v) for g, v in by_group.items()}
    for host in sorted(by_host):
        mine = [r for r in by_host[host] if r.rank not in explained]
        if not mine:
            continue
        own_by_stage: dict[int, list[float]] = {}
        for r in by_host[host]:
            own_by_stage.setdefault(r.stage, []).append(r.compute_seconds)
        own_base = {s: median_without(stage_sorted[s], own) for s, own in own_by_stage.items()}
        elsewhere = None
        if None in own_base.values():  # a stage with no one elsewhere: the run's compute elsewhere
            elsewhere = median_without(all_sorted, [r.compute_seconds for r in by_host[host]])
        stage_base = {s: (elsewhere or 0.0) if b is None else b for s, b in own_base.items()}
        compute = [_stands_out(r.compute_seconds, stage_base[r.stage], th) for r in mine]
        transfer = []
        own_paths = touching.get(host, {})
        group_base = {
            g: median_without(group_sorted[g], own_paths.get(g, [])) for g in {p.group for p in inside.get(host, ())}
        }
        for p in inside.get(host, ()):
            base = group_base[p.group]
            if base is not None:
                transfer.append(
                    _stands_out(p.transfer_seconds, base, th, small=True, floor=th.min_seconds_per_transfer * p.count)
                )
        hits = [c for c in compute if c is not None]
        if len(hits) == len(compute) and transfer and all(transfer):
            excess = statistics.median(c[0] for c in hits)
            base = statistics.median(c[1] for c in hits)
            keep(
                "host-contention",
                {"host": host},
                excess,
                base,
                f"host {host}: compute and transfers of its {len(mine)} ranks",
                {r.rank for r in mine},
            )


def attribute(
    ranks: list[RankFigures],
    paths: list[PathFigures],
    th: Thresholds = Thresholds(),
    paired: dict[int, Paired] | None = None,
) -> list[Finding]:
    """Every finding, the costliest first; [] for a healthy window. `paired`: each rank's step-by-step
    comparison with its stage peers (paired_excess), which names one slow rank inside a stage.

    Each comparison is with the median of the peers (the others of the same kind); those medians
    come from sorted lists (leave_one_out_medians), so the cost grows as n log n with ranks and paths."""
    if not ranks:
        return []
    periods = sorted([r.step_seconds for r in ranks])
    step = median_at(len(periods), periods.__getitem__) or 1e-9
    host_of = {r.rank: r.host for r in ranks}
    findings: list[Finding] = []
    explained: set[int] = set()

    def keep(cause, where, excess, base, what, culprits, min_ratio=th.min_ratio):
        ratio = excess / step
        if ratio >= min_ratio:
            findings.append(
                Finding(
                    cause,
                    where,
                    excess,
                    ratio,
                    f"{what}: +{excess * 1000:.1f} ms per step over its peers' {base * 1000:.1f} ms "
                    f"({ratio:.0%} of the {step * 1000:.0f} ms step)",
                )
            )
            explained.update(culprits)

    # 1. data: only ranks that fetch data are each other's peers.
    fetching = [r for r in ranks if r.data_seconds > 0]
    bases = leave_one_out_medians([r.data_seconds for r in fetching])
    for r, base in zip(fetching, bases):
        found = _stands_out(r.data_seconds, base, th, small=True)
        if found:
            keep(
                "slow-data",
                {"rank": r.rank, "stage": r.stage, "host": r.host},
                *found,
                f"rank {r.rank} (stage {r.stage}) data fetch",
                {r.rank},
            )

    # 2. host contention: needs other hosts to compare with.
    if len(set(host_of.values())) > 1:
        _host_contention(ranks, paths, host_of, th, explained, keep)

    # 3. compute, per stage (a TP rank's slowness shows on its whole TP group: their collectives wait).
    stages: dict[int, list[RankFigures]] = {}
    for r in ranks:
        stages.setdefault(r.stage, []).append(r)
    stage_compute = {s: statistics.median(r.compute_seconds for r in rs) for s, rs in stages.items()}
    # Each stage's slowest own compute (less its TP collectives): a stage whose compute is high only by its
    # TP waits (a rank late into them: its input came late over a slow link) computes no more itself.
    own_slowest: dict[int, float] = {}
    for s, rs in stages.items():
        own = [r.own_compute_seconds for r in rs if r.own_compute_seconds is not None]
        if len(own) == len(rs):
            own_slowest[s] = max(own)
    own_medians = {
        s: statistics.median(r.own_compute_seconds or 0.0 for r in rs) for s, rs in stages.items() if s in own_slowest
    }
    for s, value in sorted(stage_compute.items()):
        members = {r.rank for r in stages[s]}
        if members <= explained:
            continue
        found = _excess(value, [v for t, v in stage_compute.items() if t != s], th)
        if found and len(own_slowest) == len(stages) > 1:
            found = found if _excess(own_slowest[s], [v for t, v in own_medians.items() if t != s], th) else None
        if found and len(stage_compute) > 1:
            where, what = {"stage": s, "ranks": sorted(members)}, f"stage {s} compute"
            slowest = _slowest_own_compute(stages[s], th)
            if slowest is not None:
                rank, (excess, base) = slowest
                where["rank"] = rank
                what += f" (rank {rank}: +{excess * 1000:.1f} ms of its own compute over its stage peers' {base * 1000:.1f} ms)"
            keep("slow-compute", where, *found, what, members)
            continue
        # Within the stage: some of its ranks slower than the others, step by step against their noise
        # (paired), or by their window's medians (DP replicas, when no paired figures are given).
        slow = {}
        for r in stages[s]:
            figure = paired.get(r.rank) if paired else None
            if r.rank not in explained and _paired_slow(figure, th):
                assert figure is not None  # _paired_slow checks
                slow[r.rank] = (figure.excess, figure.base)
        floor = th.paired_min_ratio if slow else th.min_ratio
        if not slow and not paired and len(stages[s]) >= 3:  # at least two peers each
            bases = leave_one_out_medians([r.compute_seconds for r in stages[s]])
            for r, base in zip(stages[s], bases):
                if r.rank not in explained:
                    hit = _stands_out(r.compute_seconds, base, th)
                    if hit:
                        slow[r.rank] = hit
        if slow:
            excess = statistics.median(h[0] for h in slow.values())
            base = statistics.median(h[1] for h in slow.values())
            where = {"stage": s, "ranks": sorted(slow)}
            if len(slow) == 1:
                where["rank"] = next(iter(slow))
            keep(
                "slow-compute",
                where,
                excess,
                base,
                f"stage {s} ranks {'+'.join(map(str, sorted(slow)))} compute",
                set(slow),
                floor,
            )

    # 4. links and groups: against the other paths of the same role, less what their ranks waited for a CPU
    # beyond those paths' ranks (a starved member arrives and answers late: its instances are slower, no link is).
    roles: dict[tuple, list[PathFigures]] = {}
    for p in paths:
        roles.setdefault((p.group, p.kind), []).append(p)
    base_of: dict[int, float] = {}  # id(path) -> its role peers' median
    starved_of: dict[int, float] = {}  # id(path) -> its ranks' wait for a CPU over its role peers' median
    wait_of = {r.rank: r.cpu_wait_seconds for r in ranks}
    for role in roles.values():
        base_of.update(zip(map(id, role), leave_one_out_medians([q.transfer_seconds for q in role])))
        waits = [sum(math.nan if (w := wait_of.get(r)) is None else w for r in q.ranks) for q in role]
        if not any(map(math.isnan, waits)):  # every rank's wait read (none where a node cannot read its ranks')
            starved_of.update((id(q), max(w - b, 0.0)) for q, w, b in zip(role, waits, leave_one_out_medians(waits)))
    for p in paths:
        if set(p.ranks) & explained:
            continue  # its ranks are already explained (a host or a stage)
        if len(roles[(p.group, p.kind)]) < 2:
            continue  # no peers
        starved = starved_of.get(id(p), 0.0)
        found = _stands_out(
            p.transfer_seconds - starved, base_of[id(p)], th, small=True, floor=th.min_seconds_per_transfer * p.count
        )
        if found:
            if p.kind == "link":
                where, what = (
                    {"src": p.ranks[0], "dst": p.ranks[1], "group": p.group},
                    f"p2p link {p.ranks[0]}->{p.ranks[1]} transfer",
                )
            else:
                where, what = (
                    {"group": p.group, "ranks": list(p.ranks)},
                    f"{p.group} group {'+'.join(map(str, p.ranks))} transfer",
                )
            if starved:
                what += f" ({starved * 1000:.1f} ms more its ranks waited for a CPU, not counted)"
            keep("slow-link", where, *found, what, set())
    return sorted(findings, key=lambda f: -f.ratio)
