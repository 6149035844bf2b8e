"""parwatch.goodput against Google's ml-goodput-measurement: the same step lists, the same figures.

The expected values below were produced by ml-goodput-measurement 0.2.3 itself (pip install
ml-goodput-measurement==0.2.3 in a throwaway venv; it imports without cloud credentials), by
running its own code on the lists built here:
`goodput_utils.compute_ideal_step_time(list)`; for the start-time lists,
`GoodputCalculator(..., cloud_logger=<a logger returning {"step_count", "step_start_time"} entries>)`
then `.get_step_deviation()` (deviations) and its cache's `get_step_info().ideal_step_time`;
`goodput_utils.compute_step_deviation_from_baseline({i: d})` in its default (cumulative) and
INTERVAL modes; `goodput_utils.compute_percentile`.
"""

from __future__ import annotations

import pytest

from parwatch import goodput

TOL = 1e-9


def starts_steady_spike() -> list[tuple[int, float]]:
    """(step, start): ~2 s steps, step 5 takes 9 s (an outlier), step 8 0.4 s (under the 1 s floor)."""
    out, t = [], 1000.0
    for k in range(12):
        out.append((k, t))
        t += 9.0 if k == 5 else 0.4 if k == 8 else 2.0 + 0.01 * (k % 3)
    return out


def starts_restart() -> list[tuple[int, float]]:
    """Steps 0..6, then a restart from step 3 (3..8): the jump back breaks the chain."""
    out, t = [], 500.0
    for k in [*range(7), *range(3, 9)]:
        out.append((k, t))
        t += 1.5 + 0.125 * (k % 4)
    return out


def deviations(n: int) -> list[float]:
    """n deviations: a sawtooth, a spike every 97 steps, and the last 100 raised by 0.25 s."""
    return [((i * 37) % 101) / 1000 + (0.5 if i % 97 == 0 else 0.0) + (0.25 if i >= n - 100 else 0.0) for i in range(n)]


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ([2.0, 2.1, 1.9, 2.05, 1.95, 2.0], 2.0),
        ([3.0, 3.1, 2.9, 3.05, 12.0, 3.0, 2.95], 3.0),  # 12 s: above median + 3 MAD, left out
        ([0.5, 0.9, 1.2, 1.4, 1.3, 8.0], 1.2999999999999998),  # under 1 s: left out
        ([0.2, 0.5, 0.99], None),  # nothing reaches 1 s
        ([1.5, 2.5, 1.75, 2.25], 2.0),
        ([2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.35], 2.0),  # 2.35 > 2.0 + 3 * 0.1: the MAD is unscaled
    ],
)
def test_ideal_step_time_matches_the_library(times, expected):
    got = goodput.ideal_step_time(times)
    assert got is None if expected is None else got == pytest.approx(expected, abs=TOL)


STEADY_SPIKE = {
    0: 0.006666666666648169,
    1: 0.003333333333342736,
    2: 0.013333333333333641,
    3: 0.006666666666648169,
    4: 0.003333333333342736,
    5: 6.993333333333352,
    6: 0.006666666666648169,
    7: 0.003333333333342736,
    8: 1.606666666666671,
    9: 0.006666666666761856,
    10: 0.003333333333342736,
}
RESTART = {0: 0.1875, 1: 0.0625, 2: 0.0625, 3: 0.1875, 4: 0.1875, 5: 0.0625, 6: 0.0625, 7: 0.1875}


@pytest.mark.parametrize(
    ("starts", "ideal", "expected"),
    [(starts_steady_spike(), 2.006666666666648, STEADY_SPIKE), (starts_restart(), 1.6875, RESTART)],
)
def test_step_times_and_deviations_match_the_library(starts, ideal, expected):
    times = goodput.step_times(starts)
    got_ideal = goodput.ideal_step_time(times.values())
    assert got_ideal == pytest.approx(ideal, abs=TOL)
    got = {step: abs(t - got_ideal) for step, t in times.items()}  # the exporter's deviations, per step
    assert got.keys() == expected.keys()
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, abs=TOL), step


@pytest.mark.parametrize(
    ("n", "cumulative", "interval"),
    [
        (40, 0.31235, 0.31235),  # under 100 steps: the mean
        (150, 0.34009999999999996, 0.34009999999999996),  # the last 100's 90th percentile
        (1200, 0.29059999999999997, 0.34109999999999996),  # cumulative: less the baseline's median
    ],
)
def test_deviation_gauge_matches_the_library(n, cumulative, interval):
    values = deviations(n)
    assert goodput.deviation_gauge(values) == pytest.approx(cumulative, abs=TOL)
    assert goodput.deviation_gauge(values, cumulative=False) == pytest.approx(interval, abs=TOL)


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (25, 1.75), (50, 2.5), (90, 7.900000000000001), (100, 10.0)])
def test_percentile_matches_the_library(q, expected):
    assert goodput.percentile([3.0, 1.0, 2.0, 10.0], q) == pytest.approx(expected, abs=TOL)


def test_empty_inputs():
    assert goodput.step_times([]) == {}
    assert goodput.deviation_gauge([]) == 0.0
    assert goodput.percentile([], 90) == 0.0
