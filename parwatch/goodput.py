"""Step-time figures as Google's ml-goodput-measurement (0.2.3) defines them, so parwatch's numbers
can be set beside theirs: the ideal step time, each step's deviation from it, and the one
"step_time_deviation" gauge its monitor exports. Pure functions on lists of seconds (stdlib only).

The definitions (read from the library's source; written here from the formulas):

- step time of step k = start(k + 1) - start(k), for consecutive step numbers only;
- ideal step time = mean of the step times t >= 1 s with t <= median + 3 * MAD, where median and
  MAD (the median absolute deviation, unscaled: median |t - median|) are of the t >= 1 s;
  none when no step reaches 1 s;
- deviation of step k = |t_k - ideal|, for every step time, those under 1 s included;
- the exported gauge, from the deviations in step order: their mean below 100 steps; else the
  90th percentile (linear interpolation) of the last 100, less, once there are 1,100, the median
  of the 1,000 before them ("cumulative" mode; "interval" mode: the percentile alone).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

MIN_STEP_SECONDS = 1.0
"""Step times under this do not enter the ideal step time (the library's floor)."""
OUTLIER_MADS = 3.0
"""Step times above median + this many MADs are outliers, left out of the ideal step time."""
RECENT_STEPS = 100
BASELINE_STEPS = 1000
SPIKE_PERCENTILE = 90.0


def step_times(starts: Iterable[tuple[int, float]]) -> dict[int, float]:
    """{step: seconds} from (step number, start time) in the order they were recorded: a step's time is
    the next start less its own, where the next start is of the next step number (a restart or a
    rollback breaks the chain; a step run again takes its latest time)."""
    out: dict[int, float] = {}
    previous: tuple[int, float] | None = None
    for step, start in starts:
        if previous is not None and step == previous[0] + 1:
            out[previous[0]] = start - previous[1]
        previous = (step, start)
    return out


def ideal_step_time(times: Iterable[float], min_seconds: float = MIN_STEP_SECONDS) -> float | None:
    """The mean step time without outliers: over the times t >= min_seconds, those with
    t <= median + 3 * MAD (MAD = median |t - median|); None when no time reaches min_seconds."""
    kept = [t for t in times if t >= min_seconds]
    if not kept:
        return None
    median = statistics.median(kept)
    mad = statistics.median(abs(t - median) for t in kept)
    normal = [t for t in kept if t <= median + OUTLIER_MADS * mad]
    return statistics.fmean(normal) if normal else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values' closest ranks
    (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def deviation_gauge(
    deviations: Sequence[float],
    *,
    cumulative: bool = True,
    recent: int = RECENT_STEPS,
    baseline: int = BASELINE_STEPS,
    q: float = SPIKE_PERCENTILE,
) -> float:
    """The one step-time deviation figure the library's monitor exports, from the deviations in step
    order: 0.0 for none; their mean (of absolute values) below `recent` of them; else the q-th
    percentile of the last `recent`, less (cumulative, once there are recent + baseline) the median
    of the `baseline` before them. (The library holds the mean's threshold at its default 100 even
    when another `recent` is given; at the defaults the two agree.)"""
    values = [abs(d) for d in deviations]
    if not values:
        return 0.0
    if len(values) < recent:
        return statistics.fmean(values)
    spike = percentile(values[-recent:], q)
    if not cumulative or len(values) < recent + baseline:
        return spike
    return spike - statistics.median(values[-(recent + baseline) : -recent])
