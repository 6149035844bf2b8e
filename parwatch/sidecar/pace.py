"""How far ahead a run's counters can be: its step, its timeline (rollbacks applied). Backwards freely (a
rollback replays), forwards at most `per_second` past the run's highest value since that value was first
seen; the first value of a run sets the start. A report past that is refused, never taken as the newest
(a forged step 10^9 would make every real rank look stalled behind it, or freeze the newest view)."""

from __future__ import annotations

from collections.abc import Callable


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
