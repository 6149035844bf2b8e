"""The goodput ledger: every second of this rank's wall time, from process start, in exactly one
TimeCategory (parwatch.vocabulary; docs/goodput.md).

The collector hands it each boundary as it ends, on the host's monotonic clock:

- a step boundary closes a step period, which is split by its spans: compute (productive, less
  the collectives inside it), optimizer, data, checkpoint saves, eval, exposed communication (TP/DP
  collectives the rank waited in, DP sync), and the rest of the period, the pipeline's idle, by the
  bubble's causes (schedule, imbalance, wait). What the spans leave of the host's period (the
  period on a device clock can differ a little from the host's) is unattributed;
- any other boundary closes a gap: startup before the first one, paused while a pause holds,
  checkpoint load between a rollback and the resume;
- a rollback moves the productive time of the steps it discarded to wasted (the target step is
  exact: the collector knows the timeline); a pass the check before the optimizer step discarded (a
  re-run's first pass, all of a skipped step) is wasted when its step period closes.

So the categories sum to the wall time since process start, by construction. All of it is a few
float additions per step on the training thread.
"""

from __future__ import annotations

import os
import time
from array import array

from parwatch import ledger_view
from parwatch.vocabulary import BubbleCause, SpanKind, TimeCategory
from parwatch.wire.steps import GlobalStage

KEEP_STEPS = 100_000
"""Steps whose productive seconds are kept for a rollback (8 bytes each): a rollback further back than
this moves only what is kept (the ledger reports the steps it could not move, `wasted_untracked_steps`)."""

_OTHER = {
    SpanKind.OPTIMIZER: TimeCategory.OPTIMIZER,
    SpanKind.DP_SYNC: TimeCategory.EXPOSED_COMM,
    SpanKind.DATA: TimeCategory.DATA_WAIT,
    SpanKind.CHECKPOINT: TimeCategory.CHECKPOINT_SAVE,
    SpanKind.EVAL: TimeCategory.EVAL,
}
_BUBBLE = tuple(cause.time_category for cause in BubbleCause)


def process_start_monotonic() -> float | None:
    """When this process started, on time.monotonic's clock (Linux /proc); None where unknown."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, age)


class Ledger:
    """One rank's ledger: `seconds` partitions the wall time (productive net of rollbacks). `started_s`: the monotonic time it counts from (the process start); the
    time until the first boundary is startup."""

    def __init__(self, started_s: float, theory: float | None = None) -> None:
        self.seconds: dict[TimeCategory, float] = dict.fromkeys(TimeCategory, 0.0)
        self.started_s = started_s
        self._mark = started_s
        self._gap = TimeCategory.STARTUP
        self._first_step = 0
        self._cumulative = array("d")
        """Productive seconds of this timeline's steps _first_step.. summed up to each one (a rollback
        to step c discards the last value minus c's)."""
        self.theory = theory
        """The schedule's bubble at uniform stages: splits the idle until the causes are known."""
        self.split: tuple[float, float, float] | None = None
        """This rank's stage's latest (schedule, imbalance, wait) shares of its bubble (set from the
        shipper's thread as the causes are computed; one tuple, replaced whole)."""
        self.untracked_steps = 0

    # --- the collector's calls -------------------------------------------------------------
    def step(self, step: int, end_s: float, stats, idle_seconds: float, discarded: float = 0.0) -> None:
        """A step period ended at `end_s` (monotonic): split it by its spans (a StepStats) and its idle
        (the step period on the collector's clock less compute and other). `discarded`: the productive
        seconds of passes the check before the optimizer step threw away (a re-run's first pass, all of a
        skipped step), which are wasted."""
        period = max(0.0, end_s - self._mark)
        computed = max(0.0, stats.compute_seconds - stats.comm_in_compute_seconds)
        discarded = min(max(0.0, discarded), computed)
        productive = computed - discarded
        parts = {
            TimeCategory.PRODUCTIVE: productive,
            TimeCategory.WASTED: discarded,
            TimeCategory.EXPOSED_COMM: stats.comm_seconds,
        }
        for kind, seconds in stats.other_by_kind.items():
            category = _OTHER.get(kind, TimeCategory.UNATTRIBUTED)
            parts[category] = parts.get(category, 0.0) + seconds
        bubble = max(0.0, idle_seconds - (stats.comm_seconds - stats.comm_in_compute_seconds))
        for category, share in zip(_BUBBLE, self._shares(bubble, computed)):
            parts[category] = parts.get(category, 0.0) + share
        spanned = sum(parts.values())
        # The period on the host clock; the spans on the collector's (a device clock differs a little).
        scale = period / spanned if spanned > period > 0 else 1.0
        seconds = self.seconds
        for category, value in parts.items():
            seconds[category] += value * scale
        seconds[TimeCategory.UNATTRIBUTED] += max(0.0, period - spanned * scale)
        self._keep(step, productive * scale)
        self._mark = max(self._mark, end_s)

    def gap(self, end_s: float, *, holding: bool = False) -> None:
        """A non-step boundary ended at `end_s`: the time since the last mark is the current gap's.
        `holding`: a heartbeat of a pause that goes on (the gap stays paused)."""
        self._close_gap(end_s)
        if not holding:
            self._gap = TimeCategory.UNATTRIBUTED

    def paused(self, now_s: float) -> None:
        """A pause holds from now until the resume boundary: paused time."""
        self._close_gap(now_s)
        self._gap = TimeCategory.PAUSED

    def loaded(self, now_s: float) -> None:
        """A checkpoint was loaded (the trainer reports it once the load is done): the time since the
        last boundary is checkpoint load, until the resume boundary."""
        self._gap = TimeCategory.CHECKPOINT_LOAD
        self._close_gap(now_s)

    def rollback(self, to_step: int, now_s: float) -> None:
        """A rollback to `to_step` was loaded: the productive time of the later steps becomes wasted,
        and the load is checkpoint load."""
        self.loaded(now_s)
        kept, index = self._cumulative, to_step - self._first_step  # kept[index]: through to_step
        wasted = 0.0
        if kept and index < 0:  # further back than what is kept: move what is kept
            self.untracked_steps += -index - 1
            wasted = kept[-1]
            del kept[:]
            self._first_step = to_step + 1
        elif index < len(kept) - 1:
            wasted = kept[-1] - kept[index]
            del kept[index + 1 :]
        self.seconds[TimeCategory.PRODUCTIVE] -= wasted
        self.seconds[TimeCategory.WASTED] += wasted

    def close(self, end_s: float) -> None:
        """The rest, to `end_s` (the collector's close): the open gap's (unattributed: shutdown)."""
        self.gap(end_s)

    def snapshot(self) -> dict[TimeCategory, float]:
        """The ledger as counters (what summaries carry and the sidecar exports): each category only
        grows, so `productive` is gross here, rollbacks' discarded part included, and `wasted` counts
        that part again. The categories other than wasted sum to the wall time; net productive is
        productive - wasted."""
        return ledger_view.as_counters(self._net())

    def _net(self) -> dict[TimeCategory, float]:
        """Seconds per category, net (productive less what rollbacks discarded)."""
        return {category: max(0.0, value) for category, value in self.seconds.items()}

    def total(self) -> float:
        return sum(self.seconds.values())

    def report(self) -> dict:
        """The ledger with its totals: wall seconds, goodput (productive / wall) and ETTR (see
        docs/goodput.md)."""
        wall = self.total()
        view = ledger_view.totals([self.snapshot()]) or {"goodput_ratio": None, "ettr": None}
        return {
            "wall_seconds": wall,
            "time_seconds": self._net(),
            "goodput_ratio": view["goodput_ratio"],
            "ettr": view["ettr"],
            "wasted_untracked_steps": self.untracked_steps,
        }

    # --- internals -------------------------------------------------------------------------
    def _close_gap(self, end_s: float) -> None:
        if end_s > self._mark:
            self.seconds[self._gap] += end_s - self._mark
            self._mark = end_s

    def _shares(self, bubble: float, productive: float) -> tuple[float, float, float]:
        split = self.split
        if split is not None:
            return bubble * split[0], bubble * split[1], bubble * split[2]
        # No causes yet (the first steps, or no replayable order): what the schedule implies for
        # this rank's compute is schedule, the rest wait.
        theory = self.theory if self.theory is not None and 0.0 <= self.theory < 1.0 else 0.0
        schedule = min(bubble, theory / (1.0 - theory) * productive)
        return schedule, 0.0, bubble - schedule

    def _keep(self, step: int, productive: float) -> None:
        kept = self._cumulative
        if step != self._first_step + len(kept):  # not the next step of this timeline: start over
            self._first_step, kept = step, array("d")
            self._cumulative = kept
        kept.append((kept[-1] if kept else 0.0) + productive)
        if len(kept) > 2 * KEEP_STEPS:  # drop the oldest half at once (amortised O(1) a step)
            del kept[:KEEP_STEPS]
            self._first_step += KEEP_STEPS


def shares_of(stage: GlobalStage) -> tuple[float, float, float] | None:
    """(schedule, imbalance, wait) shares of a global view stage's bubble (its causes clamped at 0,
    normalised to 1); None when it has no causes or no bubble."""
    ratios = [getattr(stage, cause.ratio_field) for cause in BubbleCause]
    if None in ratios:
        return None
    parts = [max(0.0, ratio) for ratio in ratios]
    total = sum(parts)
    if total <= 0:
        return None
    return parts[0] / total, parts[1] / total, parts[2] / total
