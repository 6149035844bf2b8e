"""A core starved on purpose: this process pinned to one core, and busy loops sharing it (the CPU-wait tests)."""

from __future__ import annotations

import contextlib
import os
import subprocess


@contextlib.contextmanager
def on_one_core():
    """This process, and what it starts meanwhile, on one of its cores; yields that core."""
    cores = os.sched_getaffinity(0)
    core = max(cores)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def spinning(n: int):
    """`n` busy loops, each in a session of its own: with autogroup scheduling a session shares a core with the
    others as one, so n loops in one session would take one share (as the trainer's own session does), not n."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
