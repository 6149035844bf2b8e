"""How far ahead a run's counters can be: its step, its timeline (rollbacks applied). Backwards freely (a
rollback replays), forwards only as far as the run can have moved since it was last seen there. A report
past that is refused, never taken as the newest (a forged step 10^9 would make every real rank look stalled
behind it, or freeze the newest view).

`Pace` (the timeline, and steps where no rank is named) measures from the run's own highest value. `RunPace`
(steps, per rank) measures a rank's claim from the OTHER ranks' reports, so one rank's claims cannot carry
themselves forward (a forgery accepted would otherwise move the allowance for the next), and at the run's
observed pace (PACE_FACTOR x its median step rate), not at the most any run could go.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

PACE_FACTOR = 4.0
"""A rank may be this many times the run's median step rate ahead of the others' last report."""
SLACK_STEPS = 2
"""... plus this many steps: the ranks' reports of one boundary arrive a moment apart."""
REPORT_WINDOW_SECONDS = 2.0
"""... plus this long at that rate: a rank posts its summaries in batches (its shipper every half second, later
under load), so one rank's post can hold steps the other ranks ran too but have not posted yet."""
FRESH_SECONDS = 10.0
"""Another rank's report older than this corroborates nothing (it may have stopped): the rank's own counts."""
REPORT_AGE_SECONDS = 5.0
"""A report counts from when its step ended, as its rank says, up to this long before it arrived: a sidecar
busy for seconds (a tracker's import under load) takes every rank's queued post at once, and rank 0's step 1
taken just before rank 1's backlog of steps 2-9 said the run was at step 1 "0.0 s ago" (a real batch refused,
its steps lost: the README's test run on fa4ad6a). A rank's word on its own time widens what the other ranks
may claim (a credential speaks for one rank) and, where no other rank is fresh, its own allowance by at most
this long at the run's pace."""
STEP_SECONDS_KEPT = 64


class Pace:
    def __init__(self, clock: Callable[[], float], per_second: float, unit: str):
        self.clock, self.per_second, self.unit = clock, per_second, unit
        self.run_id: str | None = None
        self.high: int | None = None
        self.at = 0.0

    def too_far(self, run_id: str, value: int) -> str | None:
        """Why `value` is further ahead than the run can be (the caller names the field), or None."""
        if run_id != self.run_id or self.high is None or value <= self.high:
            return None
        elapsed = max(0.0, self.clock() - self.at)
        if value <= self.high + 1 + int(elapsed * self.per_second):
            return None
        return (
            f"={value} is ahead of the run: its highest {self.unit} is {self.high}, first seen {elapsed:.1f} s "
            f"ago, and a run moves at most {self.per_second:g} {self.unit}s a second"
        )

    def note(self, run_id: str, value: int) -> None:
        if run_id != self.run_id:
            self.run_id, self.high = run_id, None
        if self.high is None or value > self.high:
            self.high, self.at = value, self.clock()


class RunPace:
    """A run's steps as its ranks report them: the two highest of distinct ranks (with when each was first
    seen) and the run's recent step times. O(1) a report: the leader checks every row of every digest."""

    def __init__(self, clock: Callable[[], float], most_per_second: float):
        self.clock, self.most_per_second = clock, most_per_second
        self.run_id: str | None = None
        self.top: list[list] = []
        """Up to two [step, rank, when it ended (pace clock)], highest first, of distinct ranks."""
        self.refused: list[list] = []
        """Up to two [step, rank, when], highest first, of distinct ranks: claims refused lately. Another
        rank's own claim corroborates: without it two ranks refused against each other's last accepted
        step (a long first step had set the pace at 1 step/s) were refused for the rest of the run, and
        their node's picture of them stayed at step 1 (a false hang at its end; CI on 5a1c468)."""
        self._seconds: deque[float] = deque(maxlen=STEP_SECONDS_KEPT)
        self._rate: tuple[float, float] | None = None  # (rate, when computed): once a second at most

    def rate(self) -> float:
        """Steps a second a rank may run ahead: PACE_FACTOR x the run's median rate, at most most_per_second."""
        now = self.clock()
        if self._rate is None or not 0 <= now - self._rate[1] < 1.0:
            median = statistics.median(self._seconds) if self._seconds else 0.0
            rate = min(self.most_per_second, PACE_FACTOR / median) if median > 0 else self.most_per_second
            self._rate = (rate, now)
        return self._rate[0]

    def too_far(self, run_id: str, step: int, rank: int, beside: tuple[int, int] | None = None) -> str | None:
        """Why rank `rank`'s `step` is further ahead than the other ranks' reports allow, or None. `beside`:
        (step, rank) of another rank's summary in the same post (it corroborates too)."""
        top = self.top
        if run_id != self.run_id or not top or step <= top[0][0]:  # no further than any rank reached: most reports
            return None
        if beside is not None and beside[1] != rank and step <= beside[0] + SLACK_STEPS:
            return None
        now = self.clock()
        other = next((t for t in self.top if t[1] != rank and now - t[2] <= FRESH_SECONDS), None)
        high, who, at = other if other is not None else self.top[0]
        if step <= high:
            return None
        elapsed = max(0.0, now - at)  # since the step ended on that rank, as far as it is believed
        rate = self.rate()
        if step <= high + SLACK_STEPS + int((elapsed + REPORT_WINDOW_SECONDS) * rate):
            return None
        near = SLACK_STEPS + int(REPORT_WINDOW_SECONDS * rate)  # what one boundary's reports may differ by
        if any(r != rank and now - t <= FRESH_SECONDS and abs(step - s) <= near for s, r, t in self.refused):
            return None  # another rank claims about as far: two ranks agree (a credential speaks for one rank)
        self._keep_refused(step, rank, now)
        by = f"rank {who}'s" if who != rank else "its own"
        return (
            f"={step} is ahead of the run: the highest step is {by} {high}, ended {elapsed:.1f} s ago, "
            f"and this run moves at most {rate:.3g} steps a second ({PACE_FACTOR:g}x its median pace)"
        )

    def _keep_refused(self, step: int, rank: int, now: float) -> None:
        kept = [e for e in self.refused if e[1] != rank and now - e[2] <= FRESH_SECONDS]
        kept.append([step, rank, now])
        kept.sort(key=lambda e: -e[0])
        self.refused = kept[:2]

    def note(
        self, run_id: str, step: int, rank: int, step_seconds: float | None = None, ended: float | None = None
    ) -> None:
        """`ended`: when the step ended, as the rank says, on this pace's clock (taken at most
        REPORT_AGE_SECONDS back, never ahead of now); None: when it arrived."""
        now = self.clock()
        at = now if ended is None else min(now, max(now - REPORT_AGE_SECONDS, ended))
        if run_id != self.run_id:
            self.run_id, self.top, self.refused = run_id, [], []
            self._seconds.clear()
            self._rate = None
        if step_seconds is not None and step_seconds > 0:
            self._seconds.append(step_seconds)
        top = self.top
        for entry in top:
            if entry[1] == rank:
                if step > entry[0]:
                    entry[0], entry[2] = step, at
                    top.sort(key=lambda t: -t[0])
                return
        if len(top) < 2 or step > top[-1][0]:
            top.append([step, rank, at])
            top.sort(key=lambda t: -t[0])
            del top[2:]

    @property
    def high(self) -> int | None:
        return self.top[0][0] if self.top else None
