"""A rank's claims about its process, checked against what the sidecar knows before a summary is stored.

A summary says when its process started (`process_start_time`), which process it is (`pid`) and how its
wall time went (`time_seconds`). Taken at face value, one forged start time made every later real summary
"a late post of a restarted process" and dropped it; forged restarts counted steps again; forged counters
went backwards on /metrics. So (each refusal a 4xx naming the field, counted as a refused post):
- a start after this sidecar's clock (less CLOCK_SKEW_SECONDS), or far before the run's first summary here
  (STARTUP_SECONDS, or further only as far as the rank's own ledger goes back), is refused (422);
- on this node the sidecar proves the post's connection is held by `pid` and reads that process's real
  start (pid_owner.Proofs): a start that disagrees is refused (422), and a proven process is the rank's
  until it ends: posts of the rank from any other process are refused (409);
- a restart (a later start) is taken only when the process it replaces is gone (a proven pid that still
  runs: 409) and started after that process's last post here (409): a process cannot start before the one
  it replaces stopped;
- a post of an earlier process than the rank's current one is refused (409), never answered 200 and dropped;
- ledger counters only grow within a process and add up to no more than the wall time since it started.
"""

from __future__ import annotations

from collections.abc import Callable

from parwatch import ledger_view
from parwatch.sidecar.pid_owner import process_started
from parwatch.vocabulary import TimeCategory
from parwatch.wire.steps import StepSummary

CLOCK_SKEW_SECONDS = 2.0
"""A rank's clock and the sidecar's may disagree this much (the node's ranks share its clock; NTP elsewhere)."""
STARTUP_SECONDS = 3600.0
"""A rank's first process may have started this long before the run's first summary here (imports,
rendezvous, loading a checkpoint and data), or as long as its own ledger says."""
COUNTER_EPSILON = 1e-6

Prove = Callable[[int | None], float | None]
"""pid -> its real start when it holds the post's connection, else None (pid_owner.Proofs.started)."""


class Refused(ValueError):
    """A summary the store will not hold; `status` is the HTTP answer, the message names the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_WASTED = TimeCategory.WASTED


def _wall(s: StepSummary) -> float:
    """The wall time the summary's ledger covers (ledger_view.wall_of: every category but wasted)."""
    return sum(v for c, v in s.time_seconds.items() if c is not _WASTED) if s.time_seconds else 0.0


def check_process(rec, s: StepSummary, where: str, now: float, first_here: float, prove: Prove | None) -> None:
    """Refused unless `s`'s process claims fit what the sidecar knows of rank s.rank (`rec`: its record, or
    None for its first summary here; `first_here`: the run's first summary here, sidecar clock)."""
    start = s.process_start_time
    if start is not None and start > now + CLOCK_SKEW_SECONDS:
        raise Refused(
            422,
            f"{where}.process_start_time={start:.3f} is after this sidecar's clock ({now:.3f}): "
            "a process does not start in the future",
        )
    if rec is None or rec.started is None or start is None or ledger_view.same_process(start, rec.started):
        if rec is None and start is not None and start < first_here - STARTUP_SECONDS - _wall(s):
            raise Refused(
                422,
                f"{where}.process_start_time={start:.3f} is {first_here - start:.0f} s before the run's first "
                f"summary here, more than startup ({STARTUP_SECONDS:g} s) and its own ledger account for",
            )
        if rec is not None and rec.pid is not None:
            _check_bound(rec, s, where, prove)
        else:
            _check_proof(s, where, prove)
        if rec is not None and rec.started is not None and start is not None:
            _check_counters(rec, s, where)
        _check_wall(s, where, now)
        return
    if start < rec.started:
        raise Refused(
            409,
            f"{where}.process_start_time={start:.3f}: a post of rank {s.rank}'s earlier process; the process "
            f"that started at {rec.started:.3f} replaced it here",
        )
    # A restart: the process it replaces must be gone, and have stopped before this one started.
    if rec.pid is not None and _still_runs(rec.pid, rec.started):
        raise Refused(
            409,
            f"{where}.process_start_time={start:.3f}: rank {s.rank}'s process pid {rec.pid} (started "
            f"{rec.started:.3f}) still runs on this node; a restart is taken once it has ended",
        )
    if start < rec.last_post - CLOCK_SKEW_SECONDS:
        raise Refused(
            409,
            f"{where}.process_start_time={start:.3f}: rank {s.rank}'s process that started at "
            f"{rec.started:.3f} posted here at {rec.last_post:.3f}, after that; a restarted process starts "
            "after the one it replaces stopped",
        )
    _check_proof(s, where, prove)
    _check_wall(s, where, now)


def _check_proof(s: StepSummary, where: str, prove: Prove | None) -> None:
    """Where the post's connection proves its pid, the start it claims must be that process's."""
    if prove is None or s.pid is None or s.process_start_time is None:
        return
    real = prove(s.pid)
    if real is not None and not ledger_view.same_process(real, s.process_start_time):
        raise Refused(
            422,
            f"{where}.process_start_time={s.process_start_time:.3f} is not when pid {s.pid}, which holds this "
            f"connection, started ({real:.3f})",
        )


def _check_bound(rec, s: StepSummary, where: str, prove: Prove | None) -> None:
    """Rank s.rank's process was proven here (pid rec.pid): only that process speaks for the rank."""
    if s.pid == rec.pid and prove is not None and prove(rec.pid) is not None:
        return
    raise Refused(
        409,
        f"{where}: rank {s.rank}'s process here is pid {rec.pid}, proven by its own connection; this post "
        f"does not come from it (pid {s.pid}), and a rank's process speaks for the rank alone until it ends",
    )


def _still_runs(pid: int, started: float) -> bool:
    real = process_started(pid)
    return real is not None and ledger_view.same_process(real, started)


def _check_wall(s: StepSummary, where: str, now: float) -> None:
    """The ledger counts the process's wall time since its start: no more than the clock allows."""
    if s.time_seconds is None or s.process_start_time is None:
        return
    wall, lived = _wall(s), now - s.process_start_time + CLOCK_SKEW_SECONDS
    if wall > lived:
        raise Refused(
            422,
            f"{where}.time_seconds add up to {wall:.3f} s, more than the {lived:.3f} s since its process started",
        )


def _check_counters(rec, s: StepSummary, where: str) -> None:
    """Within one process the ledger's counters only grow (in training order: (timeline, step))."""
    old, new = rec.summary.time_seconds, s.time_seconds
    if old is None or new is None or s.key == rec.summary.key:
        return
    later = s.key > rec.summary.key
    for category, a in old.items():
        b = new.get(category, 0.0)
        if (b < a - COUNTER_EPSILON) if later else (b > a + COUNTER_EPSILON):
            raise Refused(
                422,
                f"{where}.time_seconds.{category}={b:g} {'went back from' if later else 'is past'} {a:g} "
                f"({'step' if later else 'a later step'} {rec.summary.step} of the same process): "
                "a ledger's counters only grow",
            )
