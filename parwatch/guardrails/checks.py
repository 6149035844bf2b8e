"""One small object per check kind, and the per-rule state machine that composes them.

A check turns one observation of a metric ({series key: value}) into a Reading: the
value it judged, whether that fails, and the line it was compared against. spike and
regression keep a rolling window of earlier values for their baseline. RuleMonitor adds
the time dimension, like Prometheus' `for:`: ok -> pending (failing, not yet for_steps
consecutive evaluations / for_seconds) -> firing, and back to ok on a passing reading.
A threshold or a regression reduced by max or min counts for_steps per series, as Prometheus' `for:`
does: it fires when one series has failed that many evaluations in a row, and names it. Series that take
turns being the worst (a stage skew whose slowest stage flips in the first steps, a one-step spike of another
finding) fire nothing: CI on 198d3d9 named a noise spike of one step over the 10% slower rank of the
four steps before it, and on cf439b5 alerted on a skew of stage 0, then stage 1, in a run's first steps;
CI on 7dc4185 took a different collective path over 2x its own median in each of 10 steps of a healthy run
on a loaded host (the PP send 2 -> 0 three times, then 3 -> 1, 0 -> 2, 1 -> 3, a TP all-reduce) for a
degraded link.
Other checks count the reduced value's failing evaluations, and name the series that gave it most often.

Cost per step matters (the sidecar evaluates on its event loop, with series per rank):
a Series memoises its reductions for the rules that share a metric, reductions run in C
built-ins (sum/max/min/count) rather than sorting keys, and baselines keep their window
sorted so a median is a lookup, not a sort.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

from msgspec import UNSET

from parwatch.guardrails.attribution import median_at
from parwatch.guardrails.rules import MIN_BASELINE_VALUES, Rule
from parwatch.vocabulary import CheckKind, Comparison, Reduce, RuleState
from parwatch.wire.findings import NO_DATA, REGRESSION_VALUES, RuleEvidence

MAX_WINDOW_VALUES = 200
"""Values of one failing run kept as evidence (the newest ones)."""
MAX_SERIES_PER_RULE = 1024
"""Bound on per-series baselines a regression keeps (labels are bounded; this guards a bug)."""


@dataclass(frozen=True)
class Reading:
    value: float
    """The judged value: the reduced value (regression: the reduced ratio to baseline)."""
    failing: bool
    series: str | None
    """Which series key gave the value (None for mean)."""
    threshold: float | None
    """What the value was compared against (None when not judged)."""
    baseline: float | None
    """spike/regression: the median the factor multiplies."""
    text: str
    """One line for a person: what was seen."""
    failing_keys: frozenset | None = None
    """Threshold by max or min: the series failing on their own (for_steps counts per series); None: the
    check judges the reduced value only."""


def reduce_series(values: dict[str, float], how: Reduce) -> tuple[float, str | None]:
    """(value, key) over the non-NaN series; (nan, None) when there is none.

    max/min: among equal values, the smallest key wins (the first in sorted order).
    """
    if not values:
        return math.nan, None
    total = sum(values.values())
    if math.isnan(total):  # a NaN among them (or inf and -inf): drop the NaNs
        values = {k: v for k, v in values.items() if not math.isnan(v)}
        if not values:
            return math.nan, None
        total = sum(values.values())
    if how == Reduce.MEAN:
        return total / len(values), None
    numbers = list(values.values())
    best = max(numbers) if how == Reduce.MAX else min(numbers)
    ties = numbers.count(best)
    if ties == 1:
        key = list(values)[numbers.index(best)]
    elif ties == len(numbers):  # all equal, e.g. every rank up
        key = min(values)
    else:
        key = min(k for k, v in values.items() if v == best)
    return values[key], key


class Series:
    """One metric's usable values in one observation; reductions are shared by the rules reading it."""

    __slots__ = ("_all_finite", "_reduced", "values")

    def __init__(self, values: dict[str, float]):
        self.values = values
        self._reduced: dict[str, tuple[float, str | None]] = {}
        self._all_finite: bool | None = None

    def __bool__(self) -> bool:
        return bool(self.values)

    def reduce(self, how: Reduce) -> tuple[float, str | None]:
        out = self._reduced.get(how)
        if out is None:
            out = self._reduced[how] = reduce_series(self.values, how)
        return out

    def all_finite(self) -> bool:
        if self._all_finite is None:
            # A finite sum proves every term finite; otherwise look value by value.
            self._all_finite = math.isfinite(sum(self.values.values())) or all(
                math.isfinite(v) for v in self.values.values()
            )
        return self._all_finite


def as_series(values) -> Series:
    return values if isinstance(values, Series) else Series(values)


def series_labels(key: str | None) -> dict[str, int | str | list[int]]:
    """ "cause=slow-link,src=0,dst=2" -> {"cause": "slow-link", "src": 0, "dst": 2}; '+'-joined
    values become lists of ints ("ranks=0+1"), and `ranks` is a list when it names one rank too; a key
    without '=' gives {}."""
    out: dict[str, int | str | list[int]] = {}
    for part in (key or "").split(","):
        name, eq, value = part.partition("=")
        if not eq:
            continue
        if name == "ranks" and value.isdigit():
            out[name] = [int(value)]
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        elif "+" in value and all(v.isdigit() for v in value.split("+")):
            out[name] = [int(v) for v in value.split("+")]
        else:
            out[name] = value
    return out


def _label(metric: str, key: str | None) -> str:
    return f"{metric}{{{key}}}" if key else metric


class ThresholdCheck:
    def __init__(self, rule: Rule):
        self.rule = rule

    def read(self, series: Series) -> Reading | None:
        value, key = series.reduce(self.rule.reduce)
        if math.isnan(value):
            return None
        comparison, line = self.rule.bound()
        failing = self._fails(value, comparison, line)
        keys = None
        if self.rule.reduce in (Reduce.MAX, Reduce.MIN) and failing:
            keys = frozenset(k for k, v in series.values.items() if self._fails(v, comparison, line))
        return Reading(value, failing, key, line, None, self.describe(key, value), keys)

    @staticmethod
    def _fails(value: float, comparison: Comparison, line: float) -> bool:
        return value > line if comparison == Comparison.ABOVE else value < line

    def describe(self, key: str | None, value: float) -> str:
        comparison, line = self.rule.bound()
        word = ("" if self._fails(value, comparison, line) else "not ") + comparison
        return f"{self.rule.reduce} {_label(self.rule.metric, key)} = {value:.4g}, {word} {line:g}"

    def history(self) -> dict:
        return {}

    def restore(self, saved: dict) -> None:
        pass


class FiniteCheck(ThresholdCheck):
    def read(self, series: Series) -> Reading | None:
        if not series.all_finite():
            bad_key, bad = min((k, v) for k, v in series.values.items() if not math.isfinite(v))
            return Reading(bad, True, bad_key, None, None, f"{_label(self.rule.metric, bad_key)} is {bad}")
        value, key = series.reduce(Reduce.MAX)
        return Reading(value, False, key, None, None, f"{_label(self.rule.metric, key)} = {value:.4g} (finite)")


class SpikeCheck(ThresholdCheck):
    """Reduced value > factor x the median of the previous window_steps reduced values."""

    def __init__(self, rule: Rule):
        super().__init__(rule)
        self.factor, self.window_steps = rule.baseline_terms()
        self.values = RollingWindow(self.window_steps)

    def read(self, series: Series) -> Reading | None:
        value, key = series.reduce(self.rule.reduce)
        if not math.isfinite(value):
            return None  # not part of any baseline; the finite check is the one that judges it
        baseline = _baseline(self.values, self.window_steps)
        self.values.append(value)
        label = _label(self.rule.metric, key)
        if baseline is None:
            return Reading(value, False, key, None, None, f"{label} = {value:.4g} (building baseline)")
        line = self.factor * baseline
        failing = value > line
        text = f"{label} = {value:.4g}, {value / baseline:.3g}x its median {baseline:.4g} (factor {self.factor:g})"
        return Reading(value, failing, key, line, baseline, text)

    def history(self) -> dict:
        return {"values": self.values.to_list()}

    def restore(self, saved: dict) -> None:
        self.values.extend(saved.get("values", ()))


class RegressionCheck(ThresholdCheck):
    """Per series: value / median of that series' previous window_steps values; reduce the ratios."""

    def __init__(self, rule: Rule):
        super().__init__(rule)
        self.factor, self.window_steps = rule.baseline_terms()
        self.values: dict[str, RollingWindow] = {}
        self.ratios: dict[str, float] = {}
        self.baselines: dict[str, float] = {}
        """The newest reading's judged series: their ratios and baselines."""

    def read(self, series: Series) -> Reading | None:
        # Once per step over every path of a node (~900 at 1,024 ranks) on the sidecar's event loop:
        # _baseline and RollingWindow.append written out here, without a call per series.
        ratios: dict[str, float] = {}
        baselines: dict[str, float] = {}
        windows, window_steps = self.values, self.window_steps
        floor = self.rule.min_increase  # a rise no larger than this is no regression: the series is not judged
        enough = min(MIN_BASELINE_VALUES, window_steps)
        isfinite = math.isfinite
        for key, value in sorted(series.values.items()):
            if not isfinite(value):
                continue
            past = windows.get(key)
            if past is None:
                if len(windows) >= MAX_SERIES_PER_RULE:
                    continue
                past = windows[key] = RollingWindow(window_steps)
            arrived, ordered = past.arrived, past.ordered
            n = len(ordered)
            if n >= enough:
                mid = n // 2
                baseline = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
                if baseline > 0 and (floor is None or value - baseline > floor):
                    ratios[key], baselines[key] = value / baseline, baseline
            if n == window_steps:
                del ordered[bisect_left(ordered, arrived[0])]
            arrived.append(value)
            insort(ordered, value)
        if not ratios:
            return None
        ratio, worst = reduce_series(ratios, self.rule.reduce)
        median = baselines.get(worst) if worst is not None else None  # None: a mean over every series
        failing = ratio > self.factor
        keys = None
        if self.rule.reduce in (Reduce.MAX, Reduce.MIN) and failing:
            keys = frozenset(k for k, r in ratios.items() if r > self.factor)
        self.ratios, self.baselines = ratios, baselines
        return Reading(ratio, failing, worst, self.factor, median, self._text(worst, ratio, median), keys)

    def describe(self, key: str | None, value: float) -> str:
        """The series' newest ratio (a failing run names the series failing longest, not this step's worst)."""
        return self._text(key, self.ratios.get(key or "", math.nan), self.baselines.get(key or ""))

    def _text(self, key: str | None, ratio: float, median: float | None) -> str:
        return (
            f"{self.rule.reduce} {_label(self.rule.metric, key)} at {ratio:.3g}x its median"
            + (f" {median:.4g}" if median is not None else "")
            + f" (factor {self.factor:g})"
        )

    def history(self) -> dict:
        return {"values": {k: v.to_list() for k, v in self.values.items()}}

    def restore(self, saved: dict) -> None:
        for key, past in saved.get("values", {}).items():
            self.values[key] = RollingWindow(self.window_steps)
            self.values[key].extend(past)


class RollingWindow:
    """The newest `size` finite values, in arrival order and sorted (so the median is a lookup)."""

    __slots__ = ("arrived", "ordered")

    def __init__(self, size: int):
        self.arrived: deque[float] = deque(maxlen=size)
        self.ordered: list[float] = []

    def __len__(self) -> int:
        return len(self.arrived)

    def append(self, value: float) -> None:
        if len(self.arrived) == self.arrived.maxlen:
            del self.ordered[bisect_left(self.ordered, self.arrived[0])]
        self.arrived.append(value)
        insort(self.ordered, value)

    def extend(self, values) -> None:
        for v in values:
            v = float(v)
            if math.isfinite(v):  # only finite values are ever appended; NaN would break the order
                self.append(v)

    def median(self) -> float:
        """As statistics.median: the middle value, or the mean of the two middle ones."""
        return median_at(len(self.ordered), self.ordered.__getitem__)

    def to_list(self) -> list[float]:
        return list(self.arrived)


def _baseline(past: RollingWindow, window_steps: int) -> float | None:
    """Median of earlier values once there are enough; None while too few or not positive."""
    if len(past) < min(MIN_BASELINE_VALUES, window_steps):
        return None
    median = past.median()
    return median if median > 0 else None


CHECK_KINDS: dict[str, type] = {
    CheckKind.THRESHOLD: ThresholdCheck,
    CheckKind.FINITE: FiniteCheck,
    CheckKind.SPIKE: SpikeCheck,
    CheckKind.REGRESSION: RegressionCheck,
}


def make_check(rule: Rule):
    return CHECK_KINDS[rule.check](rule)


BASELINE_IDENTITY = ("metric", "check", "window_steps")
"""A saved baseline is restored only into a rule with the same values of these."""


class RuleMonitor:
    """One rule's state: ok, pending or firing, with the evidence of the current failing run."""

    SAVED = (
        "state",
        "reason",
        "failing_steps",
        "since_step",
        "since_time",
        "last_value",
        "last_series",
        "threshold",
        "baseline",
        "last_seen_time",
        "window_values",
        "window_series",
        "streaks",
        "acted_tick",
        "acted_step",
        "acted_decision",
        "switched",
    )

    def __init__(self, rule: Rule):
        self.rule = rule
        self.check = make_check(rule)
        self.state, self.reason = RuleState.OK, "no failing evaluation"
        self.failing_steps = 0
        self.since_step: int | None = None
        self.since_time: float | None = None
        self.last_value: float | None = None
        self.last_series: str | None = None
        self.threshold: float | None = None
        self.baseline: float | None = None
        self.last_seen_time: float | None = None
        self.window_values: list[float] = []
        self.window_series: list[str | None] = []
        """The series of each of window_values (their culprits)."""
        self._texts: dict[str | None, str] = {}  # series -> its newest reading's text, this failing run
        self.streaks: dict[str, int] | None = None
        """Threshold or regression by max or min: each failing series' evaluations failed in a row (the
        check's failing_keys); None: for_steps counts the reduced value's (failing_steps)."""
        self.acted_tick: int | None = None
        self.acted_step: int | None = None
        self.acted_decision: int | None = None
        """The id of the decision it last acted with: a switch decided before it does not change its run."""
        self.switched: str | None = None
        """What changed the run since the rule acted while it kept firing (a rollback or resume applied, a
        restart, a skipped step): failing again after it, the rule acts again (GuardrailEngine)."""

    def observe(self, step: int, now: float, values: dict[str, float] | Series) -> bool:
        """Judge one observation; True when it makes the rule enter firing (time to act)."""
        self.last_seen_time = now
        if self.reason == NO_DATA:
            self._clear(RuleState.OK, "data is back")
        series = as_series(values)
        reading = self.check.read(series)
        if reading is not None:
            self.last_value, self.last_series = reading.value, reading.series
            self.threshold, self.baseline = reading.threshold, reading.baseline
        if reading is None or not reading.failing:
            self._clear(RuleState.OK, reading.text if reading else "not judged yet (no usable value or baseline)")
            return False
        if self.failing_steps == 0:
            self.since_step, self.since_time, self.window_values, self.window_series = step, now, [], []
            self._texts = {}
        self.failing_steps += 1
        self.window_values.append(reading.value)
        self.window_series.append(reading.series)
        if len(self.window_values) > MAX_WINDOW_VALUES:
            del self.window_values[0], self.window_series[0]
        self._texts[reading.series] = reading.text
        if reading.failing_keys is None:
            self.streaks = None
        else:
            streaks = self.streaks or {}
            self.streaks = {k: streaks.get(k, 0) + 1 for k in reading.failing_keys}
        named = self.named_series()
        if self.streaks is not None and named in series.values and isinstance(self.check, ThresholdCheck):
            self._texts[named] = self.check.describe(named, series.values[named])
        self.reason = self._texts.get(named, reading.text)
        return self._advance(now)

    def named_series(self) -> str | None:
        """The series the failing run names: by series (streaks), the one failing longest in a row (ties:
        the judged one, else the first); else the one that gave the judged value most often, the newest
        of those that tie (the last reading's when there is no failing run)."""
        if self.streaks:
            longest = max(self.streaks.values())
            tied = sorted(k for k, n in self.streaks.items() if n == longest)
            return self.last_series if self.last_series in tied else tied[0]
        seen = self.window_series
        if not seen or len(set(seen)) == 1:
            return seen[-1] if seen else self.last_series
        counts: dict[str | None, int] = {}
        for key in seen:
            counts[key] = counts.get(key, 0) + 1
        most = max(counts.values())
        return next(key for key in reversed(seen) if counts[key] == most)

    def tick(self, now: float) -> bool:
        """Time passed without a reading: a pending for_seconds rule may now fire."""
        return self.state == RuleState.PENDING and self._advance(now)

    def no_data(self, now: float, reference: float | None) -> bool:
        """True when the metric's absence (since `reference`) just became a finding."""
        limit = self.rule.no_data_seconds
        if limit is None or reference is None or self.state == RuleState.FIRING or now - reference < limit:
            return False
        self._clear(RuleState.FIRING, NO_DATA)
        return True

    def evidence(self, step: int | None) -> RuleEvidence:
        """What a decision record shows: the failing run's values, the line they crossed, the window, and the
        place its series key names (its stage, and every label as the culprit)."""
        rule, named = self.rule, self.named_series()
        labels = series_labels(named)
        stage = labels.get("stage")
        threshold = rule.check == CheckKind.THRESHOLD
        baseline = rule.check in (CheckKind.SPIKE, CheckKind.REGRESSION)
        comparison, line = rule.bound() if threshold else (UNSET, UNSET)
        return RuleEvidence(
            metric=rule.metric,
            check=rule.check,
            series=named,
            reduce=rule.reduce,
            values=list(self.window_values),
            values_series=list(self.window_series) if len(set(self.window_series)) > 1 else UNSET,
            for_steps=rule.for_steps,
            window=(self.since_step, step),
            stage=stage if isinstance(stage, int) else UNSET,
            culprit=labels or UNSET,
            for_seconds=UNSET if rule.for_seconds is None else rule.for_seconds,
            threshold=line,
            comparison=comparison,
            factor=rule.factor if baseline else UNSET,
            baseline=self.baseline if baseline else UNSET,
            window_steps=rule.window_steps if baseline else UNSET,
            min_increase=UNSET if rule.min_increase is None else rule.min_increase,
            values_are=REGRESSION_VALUES if rule.check == CheckKind.REGRESSION else UNSET,
        )

    def _advance(self, now: float) -> bool:
        if self.state == RuleState.FIRING:
            return False
        rule = self.rule
        in_a_row = self.failing_steps if self.streaks is None else max(self.streaks.values(), default=0)
        enough_steps = in_a_row >= rule.for_steps
        long_enough = True
        if rule.for_seconds is not None:
            assert self.since_time is not None  # only failing readings lead here; the first one set it
            long_enough = now - self.since_time >= rule.for_seconds
        if enough_steps and long_enough:
            self.state = RuleState.FIRING
            return True
        self.state = RuleState.PENDING
        return False

    def _clear(self, state: RuleState, reason: str) -> None:
        self.state, self.reason = state, reason
        self.failing_steps, self.since_step, self.since_time, self.window_values = 0, None, None, []
        self.window_series, self._texts, self.streaks = [], {}, None

    def _built_for(self) -> dict:
        """What a baseline was built for: restored only into a rule that still matches."""
        return {k: getattr(self.rule, k) for k in BASELINE_IDENTITY}

    def to_dict(self, history: bool = True) -> dict:
        """The state to save; history=False leaves out the baseline windows (baseline_dict() has them)."""
        out = {**self._built_for(), **{k: getattr(self, k) for k in self.SAVED}}
        if history:
            out["history"] = self.check.history()
        return out

    def baseline_dict(self) -> dict:
        """The check's baseline windows, with what they were built for."""
        return {**self._built_for(), "history": self.check.history()}

    def restore(self, saved: dict) -> None:
        """Continue from a saved state (to_dict); its baseline if it has one (restore_baseline)."""
        for key in self.SAVED:
            if key in saved:
                setattr(self, key, saved[key])
        if len(self.window_series) != len(self.window_values):  # saved before window_series was
            self.window_series = [self.last_series] * len(self.window_values)
        self.state = RuleState(self.state)
        if "history" in saved:
            self.restore_baseline(saved)

    def restore_baseline(self, saved: dict) -> None:
        """Continue from saved baseline windows (baseline_dict), only if built for the same check."""
        if all(saved.get(k) == v for k, v in self._built_for().items()):
            self.check.restore(saved.get("history", {}))

    def reset_baseline(self) -> None:
        """Empty windows (they refill as steps come)."""
        self.check = make_check(self.rule)
