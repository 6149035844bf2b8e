"""SCHED_IDLE for the tests that run beside the serial phase (tests/serial_phase.py), and for the ranks they
start: a rank forked from tests/distutil's fork server, which started earlier, takes it from ENV."""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "PARWATCH_TEST_SCHED_IDLE"


def enter() -> None:
    """This process (and all it starts from now on) under SCHED_IDLE."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.environ[ENV] = "1"


def follow(env: Mapping[str, str]) -> None:
    """A rank: under SCHED_IDLE when the test that started it is."""
    if env.get(ENV):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
