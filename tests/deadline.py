"""The one way a test waits: poll a condition until a deadline, then raise DeadlineExceeded.

A deadline passed is never a slow figure: the thing waited for (a hang named, a server up, a
rank's result) did not happen in time, so tests/timing_rerun.py never re-runs a test that raised it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WAIT_S = 60.0
"""Generous default for waiting on a state change: other processes load this 2-core machine."""


class DeadlineExceeded(Exception):
    """What a test waited for did not come before its deadline."""


def wait_until(predicate: Callable[[], T], what: str, timeout: float = WAIT_S, interval: float = 0.1) -> T:
    """Poll predicate() until it returns something truthy (returned); DeadlineExceeded naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
