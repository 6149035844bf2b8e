"""pace.RunPace (issue 43, finding 2): a rank's step is measured against the OTHER ranks' reports, at the run's
observed pace, so forgeries cannot carry their own allowance forward."""

from __future__ import annotations

from parwatch.sidecar.pace import FRESH_SECONDS, REPORT_AGE_SECONDS, REPORT_WINDOW_SECONDS, SLACK_STEPS, RunPace


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
    window = int(REPORT_WINDOW_SECONDS * 8)  # the steps one batch may hold that the others have not posted
    assert pace.too_far("r", 5 + SLACK_STEPS + window, 0) is None  # a boundary's reports arrive apart
    assert pace.too_far("r", 5 + SLACK_STEPS + window + 1, 0) is not None
    why = pace.too_far("r", 1000, 0)
    assert why is not None and "rank 1's 5" in why and "8 steps a second" in why
    # Accepted forgeries within the allowance (rank 0's own) do not move it: rank 1's reports do.
    pace.note("r", 5 + SLACK_STEPS + window, 0)
    assert pace.too_far("r", 5 + SLACK_STEPS + window + 1, 0) is not None
    pace.note("r", 6, 1)
    assert pace.too_far("r", 6 + SLACK_STEPS + window, 0) is None


def test_a_batch_posted_just_after_the_others_first_step_is_taken():
    """A fast run (46.5 steps a second allowed): rank 0's step 2 has just arrived when rank 1's post of its
    steps 2-5 does (the shippers post half a second apart). CI refused it once (422 'ahead of the run') and
    rank 1's figures were lost."""
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    for step in (1, 2):
        pace.note("r", step, 0, step_seconds=0.086)
    pace.note("r", 1, 1, step_seconds=0.086)
    assert pace.too_far("r", 5, 1) is None
    assert pace.too_far("r", 10**6, 1) is not None


def test_a_backlog_queued_behind_a_busy_sidecar_is_taken():
    """The README's test run on fa4ad6a: the sidecar busy for seconds (importing its trackers under load)
    took rank 0's step 1 (a 1.6 s first step: 2.48 steps a second allowed) and then rank 1's backlog of steps
    2-9, both queued meanwhile. Counted from its arrival, rank 0's step 1 was "0.0 s ago" and step 9 was
    refused (422), its batch lost. Counted from when the step ended on rank 0 (3 s before), it is taken."""
    for ended_ago, taken in ((None, False), (0.0, False), (3.0, True)):
        clock = Clock()
        pace = RunPace(clock, most_per_second=1000.0)
        ended = None if ended_ago is None else clock.t - ended_ago
        pace.note("r", 1, 0, step_seconds=1.6, ended=ended)
        assert (pace.too_far("r", 9, 1) is None) is taken, ended_ago
    assert pace.too_far("r", 100, 1) is not None  # still bounded: 3 s at 2.5 steps a second


def test_a_reports_own_time_counts_at_most_report_age_back_and_never_ahead():
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    pace.note("r", 1, 0, step_seconds=1.0, ended=0.0)  # a clock far behind (or a lie): REPORT_AGE_SECONDS back
    bound = 1 + SLACK_STEPS + int((REPORT_AGE_SECONDS + REPORT_WINDOW_SECONDS) * 4)
    assert pace.too_far("r", bound, 1) is None
    assert pace.too_far("r", bound + 1, 1) is not None
    pace = RunPace(clock, most_per_second=1000.0)
    pace.note("r", 1, 0, step_seconds=1.0, ended=clock.t + 1e6)  # a clock ahead: taken as now
    assert pace.too_far("r", 1 + SLACK_STEPS + int(REPORT_WINDOW_SECONDS * 4) + 1, 1) is not None
    # A rank's own time never widens its own allowance: rank 0 alone is measured against its own report.
    pace = RunPace(clock, most_per_second=1000.0)
    pace.note("r", 1, 1, step_seconds=1.0)
    pace.note("r", 1, 0, step_seconds=1.0, ended=clock.t - REPORT_AGE_SECONDS)
    assert pace.too_far("r", 1 + SLACK_STEPS + int(REPORT_WINDOW_SECONDS * 4) + 1, 0) is not None


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


def test_two_ranks_refused_against_each_other_agree_and_are_taken():
    """CI on 5a1c468: a 4 s first step set the pace at 1 step a second; the two ranks of a node then ran 6
    steps a second and each one's report was refused against the other's last accepted step (1) for the
    rest of the run: the node's picture of them stayed at step 1, and the run's end was judged a hang of it.
    Two ranks' own claims that agree corroborate each other; one rank's claims never corroborate its own."""
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    for rank in (2, 3):
        pace.note("r", 1, rank, step_seconds=4.0)  # the long first step: 1 step a second allowed
    taken = {2: [], 3: []}
    for second in range(1, 31):  # then 6 steps a second; each rank reports once a second, 0.1 s apart
        for rank, lag in ((2, 0.0), (3, 0.1)):
            clock.t = 100.0 + second + lag
            step = 1 + int(6 * (second + lag))
            if pace.too_far("r", step, rank) is None:
                pace.note("r", step, rank, step_seconds=0.2)
                taken[rank].append(step)
    assert taken[2] and taken[3] and max(taken[2]) > 170 and max(taken[3]) > 170, taken
    assert pace.too_far("r", 10**6, 2) is not None  # still: nothing corroborates a step nobody else claims


def test_a_rank_alone_or_a_far_claim_corroborates_nothing():
    clock = Clock()
    pace = RunPace(clock, most_per_second=1000.0)
    for rank in (0, 1):
        pace.note("r", 1, rank, step_seconds=4.0)
    clock.t += 1.0
    assert pace.too_far("r", 50, 0) is not None
    assert pace.too_far("r", 51, 0) is not None  # its own refused claim does not carry it
    assert pace.too_far("r", 10**9, 1) is not None
    assert pace.too_far("r", 52, 2) is None  # rank 0's 50 and 51 were claimed: a third rank agreeing is taken
    assert pace.too_far("r", 10**9 - 10**6, 3) is not None  # far from every claim: nothing agrees with it
