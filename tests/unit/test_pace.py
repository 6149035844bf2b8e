"""pace.RunPace (issue 43, finding 2): a rank's step is measured against the OTHER ranks' reports, at the run's
observed pace, so forgeries cannot carry their own allowance forward."""

from __future__ import annotations

from parwatch.sidecar.pace import FRESH_SECONDS, SLACK_STEPS, RunPace


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_a_rank_cannot_carry_itself_ahead_of_the_others():
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    for step in range(1, 6):
        clock.t += 0.5
        for rank in (0, 1):
            pace.note("r", step, rank, step_seconds=0.5)  # a step every half second: 8 steps/s allowed
    assert pace.too_far("r", 5 + SLACK_STEPS, 0) is None  # a boundary's reports arrive a moment apart
    why = pace.too_far("r", 1000, 0)
    assert why is not None and "rank 1's 5" in why and "8 steps a second" in why
    # Accepted forgeries within the allowance (rank 0's own) do not move it: rank 1's reports do.
    pace.note("r", 5 + SLACK_STEPS, 0)
    assert pace.too_far("r", 5 + 2 * SLACK_STEPS, 0) is not None
    pace.note("r", 6, 1)
    assert pace.too_far("r", 6 + SLACK_STEPS, 0) is None


def test_a_silent_rank_corroborates_nothing_and_a_first_report_sets_the_start():
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    assert pace.too_far("r", 10**6, 0) is None  # nothing known of the run yet
    pace.note("r", 5, 1, step_seconds=1.0)
    pace.note("r", 5, 0, step_seconds=1.0)
    clock.t += FRESH_SECONDS + 1  # rank 1 went quiet: rank 0's own pace, as a run alone
    assert pace.too_far("r", 5 + 40, 0) is None  # 11 s at 4 steps/s
    assert pace.too_far("r", 5 + 100, 0) is not None
    assert pace.too_far("another run", 10**6, 0) is None
