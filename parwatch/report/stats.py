"""Numbers the report shows: bubble per stage, idle cost, collective latency from buckets."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from parwatch.bubble import closed_form, excess, has_closed_form, stage_bubble
from parwatch.vocabulary import ScheduleName, SelfPart
from parwatch.wire.steps import COLLECTIVE_BUCKETS


def parse_buckets(raw, bounds=COLLECTIVE_BUCKETS) -> list[float] | None:
    """Cumulative counts aligned with `bounds`, from a list (len n, or n+1 with +Inf last)
    or a dict keyed by the bound ("0.001", "+Inf"); None if absent or unreadable."""
    if isinstance(raw, list) and len(raw) in (len(bounds), len(bounds) + 1):
        vals = raw[: len(bounds)]
    elif isinstance(raw, dict) and raw:
        try:
            by_le = {float(k): v for k, v in raw.items() if k not in ("+Inf", "inf")}
        except ValueError:
            return None
        vals = [by_le.get(b) for b in bounds]
    else:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return None
    return [float(v) for v in vals]


def quantile_from_buckets(q: float, cumulative: list, count: float, bounds=COLLECTIVE_BUCKETS) -> float | None:
    """Prometheus histogram_quantile: linear interpolation inside the bucket holding rank q*count.
    A rank beyond the last finite bound answers that bound (the estimate cannot see further)."""
    if count <= 0:
        return None
    rank = q * count
    lower_bound, lower_count = 0.0, 0.0
    for le, cum in zip(bounds, cumulative):
        if cum >= rank:
            width = cum - lower_count
            frac = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (le - lower_bound) * frac
        lower_bound, lower_count = le, cum
    return bounds[-1]


@dataclass
class CollectiveStats:
    op: str
    group: str
    count: float = 0.0
    seconds: float = 0.0
    bytes: float = 0.0
    buckets: list | None = None
    """Summed cumulative bucket counts; None once any entry came without buckets."""
    busbw_seconds: float = 0.0
    """Sum of busbw * seconds, so busbw() is the time-weighted mean (total bytes x factor / time)."""
    _bucketless: bool = field(default=False, repr=False)

    def add(self, entry: dict) -> None:
        count, seconds = _num(entry.get("count")), _num(entry.get("seconds"))
        self.count += count
        self.seconds += seconds
        self.bytes += _num(entry.get("bytes"))
        self.busbw_seconds += _num(entry.get("busbw")) * seconds
        b = parse_buckets(entry.get("buckets"))
        if b is None:
            self._bucketless = self._bucketless or count > 0  # one bucketless entry spoils the sum
        else:
            self.buckets = b if self.buckets is None else [x + y for x, y in zip(self.buckets, b)]

    @property
    def has_buckets(self) -> bool:
        return self.buckets is not None and not self._bucketless

    def mean(self) -> float | None:
        return self.seconds / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        return (
            quantile_from_buckets(q, self.buckets, self.count)
            if self.has_buckets and self.buckets is not None
            else None
        )

    def busbw(self) -> float | None:
        return self.busbw_seconds / self.seconds if self.seconds > 0 else None


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else 0.0


def collective_totals(summaries: list) -> list[CollectiveStats]:
    """Per (op, group) over every rank and step, sorted by total time (largest first)."""
    acc: dict[tuple, CollectiveStats] = {}
    for s in summaries:
        for e in s["collectives"]:
            key = (str(e.get("op", "?")), str(e.get("group", "?")))
            acc.setdefault(key, CollectiveStats(*key)).add(e)
    return sorted(acc.values(), key=lambda c: -c.seconds)


def collective_series(summaries: list) -> tuple[dict, bool]:
    """{(op, group): [(step, seconds)]} and whether the values are p99 from buckets (True)
    or the mean seconds per op (False: some entries carried no buckets)."""
    per_step: dict[tuple, dict[int, CollectiveStats]] = defaultdict(dict)
    for s in summaries:
        for e in s["collectives"]:
            key = (str(e.get("op", "?")), str(e.get("group", "?")))
            per_step[key].setdefault(s["step"], CollectiveStats(*key)).add(e)
    use_p99 = all(c.has_buckets for steps in per_step.values() for c in steps.values())
    series = {}
    for key, steps in sorted(per_step.items()):
        pts = [(step, c.quantile(0.99) if use_p99 else c.mean()) for step, c in sorted(steps.items())]
        series[key] = [(step, v) for step, v in pts if v is not None]
    return series, use_p99


def per_stage_series(summaries: list, key: str) -> dict[int, list]:
    """{stage: [(step, mean over the stage's ranks of key)]} for finite values."""
    acc: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        v = s.get(key)
        if isinstance(v, float) and math.isfinite(v):
            acc[s["stage"]][s["step"]].append(v)
    return {
        stage: [(step, sum(v) / len(v)) for step, v in sorted(steps.items())] for stage, steps in sorted(acc.items())
    }


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _idle_compute(summaries: list) -> dict[int, dict[int, list]]:
    """{stage: {step: [idle, compute]}} summed over the stage's ranks (idle as the sidecar's counter adds it)."""
    acc: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for s in summaries:
        idle, compute = s.get("idle_seconds"), s.get("compute_seconds")
        if _finite(idle) and _finite(compute):
            sums = acc[s["stage"]][s["step"]]
            sums[0] += max(idle, 0.0)
            sums[1] += compute
    return acc


def stage_bubble_series(summaries: list) -> dict[int, list]:
    """{stage: [(step, the stage's bubble over its ranks in that step)]}, parwatch.bubble's."""
    return {
        stage: [(step, stage_bubble(*sums)) for step, sums in sorted(steps.items())]
        for stage, steps in sorted(_idle_compute(summaries).items())
    }


@dataclass
class StageBubble:
    stage: int
    measured: float | None
    theoretical: float | None
    steps: int
    """Steps measured (the first step is left out when later ones exist: it carries warm-up)."""

    @property
    def excess(self) -> float | None:
        if self.measured is None or self.theoretical is None:
            return None
        return excess(self.measured, self.theoretical)


def bubble_table(summaries: list, stages: list) -> list[StageBubble]:
    """Each stage's bubble over its ranks and the steps after its first (parwatch.bubble)."""
    sums = _idle_compute(summaries)
    theory = per_stage_series(summaries, "bubble_theoretical_ratio")
    rows = []
    for stage in stages:
        steps = dict(sums.get(stage, {}))
        if len(steps) > 1:
            del steps[min(steps)]
        idle = sum(i for i, _ in steps.values())
        compute = sum(c for _, c in steps.values())
        th = theory.get(stage, [])
        rows.append(
            StageBubble(stage, stage_bubble(idle, compute) if steps else None, th[-1][1] if th else None, len(steps))
        )
    return rows


DEFAULT_PRICE_PER_GPU_HOUR = 2.5
"""USD per accelerator-hour that the demo's summary, the report's cost lines and the dashboard's price
variable start from (each takes --price-per-gpu-hour)."""


@dataclass
class CostEstimate:
    price_per_gpu_hour: float
    idle_gpu_hours: float
    """Sum over ranks and steps of idle_seconds, in hours."""
    excess_idle_gpu_hours: float
    """Idle beyond what the schedule's formula explains: the part better balance or p2p would recover."""
    bubble_now: float
    """Theoretical bubble share at the run's m: (p-1)/(v*m+p-1), or for a schedule without a closed form
    (zero bubble, V shapes) the replay of its order at equal action times the collectors reported."""
    bubble_doubled: float | None
    """Theoretical bubble share at 2m microbatches; None without a closed form."""
    recoverable_gpu_hours: float
    """Schedule idle that 2m microbatches of half the size (same work, same compute) would remove."""

    @property
    def idle_cost(self) -> float:
        return self.idle_gpu_hours * self.price_per_gpu_hour

    @property
    def excess_cost(self) -> float:
        return self.excess_idle_gpu_hours * self.price_per_gpu_hour

    @property
    def recoverable_cost(self) -> float:
        return self.recoverable_gpu_hours * self.price_per_gpu_hour


def cost_estimate(
    summaries: list, pp: int, microbatches: int, chunks: int, price: float, schedule: str = ScheduleName.ONE_F_ONE_B
) -> CostEstimate:
    """With compute C per rank and step fixed, schedule idle is C*f/(1-f) for bubble share f:
    C*(p-1)/(v*m). Doubling m halves it; that difference is what the report calls recoverable (none is
    claimed for a schedule without a closed form: its bubble at 2m is not known from this run)."""
    if has_closed_form(schedule):
        now: float = closed_form(pp, microbatches, chunks)
        doubled: float | None = closed_form(pp, 2 * microbatches, chunks)
    else:
        theories = [t for s in summaries if _finite(t := s.get("bubble_theoretical_ratio"))]
        now, doubled = (statistics.median(theories) if theories else 0.0), None
    idle = excess = recoverable = 0.0
    for s in summaries:
        i, c = s.get("idle_seconds"), s.get("compute_seconds")
        if _finite(i):
            idle += max(i, 0.0)
        if _finite(c):
            sched_now = c * now / (1 - now)
            if doubled is not None:
                recoverable += sched_now - c * doubled / (1 - doubled)
            if _finite(i):
                excess += max(i - sched_now, 0.0)
    return CostEstimate(price, idle / 3600, excess / 3600, now, doubled, recoverable / 3600)


def self_cost_shares(summaries: list) -> dict[str, float] | None:
    """parwatch's own time as a share of the steps, per part (SelfPart) and "training_thread" (hooks + collector):
    each rank's growth of its cumulative self_seconds from its first summary to its last, summed over ranks,
    over the same ranks' step seconds after their first summary. None when no summary carries self_seconds."""
    by_rank: dict[int, list] = {}
    for s in summaries:
        if s.get("self_seconds"):
            by_rank.setdefault(s["rank"], []).append(s)
    spent: dict[str, float] = {}
    steps = 0.0
    for rows in by_rank.values():
        rows.sort(key=lambda s: (s.get("process_start_time") or 0.0, s.get("timeline", 0), s["step"]))
        first, last = rows[0], rows[-1]
        if first.get("process_start_time") != last.get("process_start_time"):
            rows = [s for s in rows if s.get("process_start_time") == last.get("process_start_time")]
            first = rows[0]
        for part, seconds in last["self_seconds"].items():
            spent[part] = spent.get(part, 0.0) + seconds - first["self_seconds"].get(part, 0.0)
        steps += sum(_num(s.get("step_seconds")) for s in rows[1:])
    if not by_rank or not steps > 0:
        return None
    shares = {part: seconds / steps for part, seconds in sorted(spent.items())}
    shares["training_thread"] = shares.get(SelfPart.HOOKS, 0.0) + shares.get(SelfPart.COLLECTOR, 0.0)
    return shares
