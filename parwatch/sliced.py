"""Work cut into slices: a generator that yields where an event loop may serve others, and returns its result.

The sidecar's once-a-step work over every rank (the observation, the straggler attribution)
is written this way, so its event loop can answer posts between slices; other callers run it
through at once."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def run_through(steps: Generator[None, None, T]) -> T:
    """Run a sliced generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
