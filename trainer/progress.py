"""What each spawned rank has done, shared with the launcher, so a rank's end is told truly.

One shared array of (phase, step) per rank: the launcher reads it when a rank exits, and says
whether it failed while starting, while training (after which step) or in teardown after
training was complete (a run that trained, with an exit that did not go cleanly).
"""

from __future__ import annotations

import signal

STARTING, TRAINING, TEARDOWN, DONE = range(4)
_PHASE_NAMES = {
    STARTING: "while starting",
    TRAINING: "while training",
    TEARDOWN: "during teardown",
    DONE: "after its teardown",
}


class RankProgress:
    """One rank's view of the shared array (picklable into a spawned process)."""

    def __init__(self, shared, rank: int):
        self._shared, self._base = shared, 2 * rank

    @staticmethod
    def shared_array(ctx, nproc: int):
        return ctx.Array("q", [STARTING, 0] * nproc, lock=False)

    def starting(self) -> bool:
        return self._shared[self._base] == STARTING

    def training(self) -> None:
        self._shared[self._base] = TRAINING

    def step(self, step: int) -> None:
        self._shared[self._base + 1] = step

    def teardown(self) -> None:
        self._shared[self._base] = TEARDOWN

    def done(self) -> None:
        self._shared[self._base] = DONE


def describe_exit(shared, rank: int, exitcode: int, steps: int) -> str:
    """'rank 1 was killed by SIGABRT during teardown, after step 6 of 6' and the like."""
    phase, step = shared[2 * rank], shared[2 * rank + 1]
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    where = _PHASE_NAMES.get(phase, "")
    if phase == STARTING:
        return f"rank {rank} {how} {where}"
    return f"rank {rank} {how} {where}, after step {step} of {steps}"


def exit_status(exitcode: int) -> int:
    """A process's exit code as a shell reports it: 128 + N for a signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode
