"""What a tracker is given: a run's figures as the leader's /metrics shows them, at one step.

`Point` is one write: scalars and texts at a step. `SeriesBuilder` reads the metric families the
sidecar's registry yields (the very ones /metrics encodes), so a tracker's value is /metrics' value:
gauges as they stand, counters over the window since the previous point (the first point's window
is the run so far), each through the definition every other consumer uses (parwatch.bubble for the
bubble, parwatch.ledger_view for goodput, Prometheus' histogram_quantile for the p99).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from parwatch.bubble import stage_bubble
from parwatch.ledger_view import totals
from parwatch.vocabulary import BubbleCause

MAX_SERIES = 50
"""Scalar series per tracker run at most; beyond it the least important are left out (named in the log once)."""

Key = tuple[tuple[str, str], ...]
"""A sample's labels, sorted."""
Samples = dict[str, dict[Key, float]]
"""Sample name (with _total, _bucket, _sum, _count) -> labels -> value."""

COUNTERS = (
    "parwatch_step_duration_seconds_sum",
    "parwatch_step_duration_seconds_count",
    "parwatch_stage_compute_seconds_total",
    "parwatch_stage_idle_seconds_total",
    "parwatch_time_seconds_total",
    "parwatch_collective_duration_seconds_bucket",
)
"""The counters whose windows the series read (kept from one point to the next)."""


@dataclass(frozen=True)
class Text:
    tag: str
    """decisions | findings/straggler."""
    text: str
    step: int


@dataclass(frozen=True)
class Point:
    """One write to a tracker: the run's scalars at `step` (none for a point of texts alone) and texts."""

    run_id: str
    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    texts: tuple[Text, ...] = ()
    final: bool = False
    """The run ended here: the tracker run is finished after this point."""


def samples_of(families: Iterable) -> Samples:
    """prometheus_client families (registry.collect()) as sample name -> labels -> value."""
    out: Samples = {}
    for family in families:
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _label(key: Key, name: str) -> str:
    return dict(key)[name]


class SeriesBuilder:
    """Scalars of successive points; keeps the counters of the previous one for the windows."""

    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self.max_series = max_series
        self._before: Samples = {}
        self.left_out: set[str] = set()
        """Series names past MAX_SERIES, ever (for one log line each)."""

    def reset(self) -> None:
        """A new run: its counters start again."""
        self._before = {}

    def _window(self, now: Samples, name: str) -> dict[Key, float]:
        """A counter's growth since the previous point; a series that went back (a reset) counts from zero."""
        before = self._before.get(name, {})
        out = {}
        for key, value in now.get(name, {}).items():
            previous = before.get(key, 0.0)
            out[key] = value - previous if value >= previous else value
        return out

    def scalars(self, now: Samples) -> dict[str, float]:
        """This point's series, most important first, at most max_series; remembers the counters."""
        ordered: list[tuple[str, float]] = []
        ordered += _gauge(now, "parwatch_loss", "loss")
        step_sum = sum(self._window(now, "parwatch_step_duration_seconds_sum").values())
        step_count = sum(self._window(now, "parwatch_step_duration_seconds_count").values())
        if step_count > 0:
            ordered.append(("step_seconds", step_sum / step_count))
        mfu = list(now.get("parwatch_model_flops_utilization_ratio", {}).values())
        if mfu:
            ordered.append(("mfu", sum(mfu) / len(mfu)))
        ordered += _gauge(now, "parwatch_hang_detected", "hang_detected")
        ordered += self._goodput(now)
        ordered += self._bubbles(now)
        for key, value in sorted(now.get("parwatch_straggler_ratio", {}).items()):
            ordered.append((f"straggler/{_label(key, 'cause')}", value))
        ordered += self._collective_p99(now)
        self._before = {name: dict(now.get(name, {})) for name in COUNTERS}
        kept = dict(ordered[: self.max_series])
        self.left_out |= {name for name, _ in ordered[self.max_series :]}
        return kept

    def _goodput(self, now: Samples) -> list[tuple[str, float]]:
        by_rank: dict[str, dict[str, float]] = {}
        for key, seconds in self._window(now, "parwatch_time_seconds_total").items():
            ledger = by_rank.setdefault(_label(key, "rank"), {})
            ledger[_label(key, "category")] = ledger.get(_label(key, "category"), 0.0) + seconds
        total = totals(by_rank.values())
        if total is None or not total["rank_seconds"] > 0:
            return []
        out = [("goodput/ratio", total["goodput_ratio"]), ("goodput/ettr", total["ettr"])]
        wall = total["rank_seconds"]
        out += [(f"goodput/{c}", s / wall) for c, s in sorted(total["seconds"].items()) if s > 0]
        return out

    def _bubbles(self, now: Samples) -> list[tuple[str, float]]:
        idle: dict[str, float] = {}
        compute: dict[str, float] = {}
        for into, name in (
            (idle, "parwatch_stage_idle_seconds_total"),
            (compute, "parwatch_stage_compute_seconds_total"),
        ):
            for key, seconds in self._window(now, name).items():
                stage = _label(key, "stage")
                into[stage] = into.get(stage, 0.0) + seconds
        out = []
        for stage in sorted(set(idle) | set(compute), key=int):
            i, c = idle.get(stage, 0.0), compute.get(stage, 0.0)
            if i + c > 0:
                out.append((f"bubble/stage_{stage}/measured", stage_bubble(i, c)))
        for cause in BubbleCause:
            for key, value in sorted(now.get(cause.metric, {}).items(), key=_by_stage):
                out.append((f"bubble/stage_{_label(key, 'stage')}/{cause}", value))
        return out

    def _collective_p99(self, now: Samples) -> list[tuple[str, float]]:
        buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for key, count in self._window(now, "parwatch_collective_duration_seconds_bucket").items():
            labels = dict(key)
            buckets.setdefault((labels["op"], labels["group"]), []).append((float(labels["le"]), count))
        out = []
        for (op, group), edges in sorted(buckets.items()):
            q = histogram_quantile(0.99, edges)
            if q is not None:
                out.append((f"collective_p99/{op}/{group}", q))
        return out


def _by_stage(item: tuple[Key, float]) -> int:
    return int(_label(item[0], "stage"))


def _gauge(now: Samples, name: str, series: str) -> list[tuple[str, float]]:
    values = now.get(name, {})
    return [(series, values[()])] if () in values else []


def histogram_quantile(q: float, edges: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts [(le, count)] (+Inf included): linear
    interpolation within the bucket that holds rank q * total, the lowest bucket starting at 0; the highest
    finite edge when the rank falls in +Inf. None with no observations."""
    edges = sorted(edges)
    if not edges or edges[-1][0] != math.inf:
        return None
    total = edges[-1][1]
    if not total > 0:
        return None
    rank = q * total
    lower_edge, lower_count = 0.0, 0.0
    for le, count in edges:
        if count >= rank:
            if le == math.inf:
                return lower_edge
            if count == lower_count:
                return le
            return lower_edge + (le - lower_edge) * (rank - lower_count) / (count - lower_count)
        lower_edge, lower_count = le, count
    return None
