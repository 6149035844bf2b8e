"""Whole-run figures rank 0 adds to the trainer's --summary-json at the end of a run.

Built from the fast-path global views (every stage, one step of lag) and this
rank's own collective statistics. The first measured step is left out of the
means: it carries one-off warm-up (allocator, first gloo connections).
Running sums keep memory flat however long the run; only the last
PER_STEP_KEPT per-step bubble values are kept for the summary. A stage's bubble over
the run is parwatch.bubble's, from the summed idle and compute seconds.
"""

from __future__ import annotations

from collections import defaultdict, deque

from parwatch.bubble import closed_form, stage_bubble
from parwatch.wire.steps import Collective, GlobalView

PER_STEP_KEPT = 1000
_KEYS = ("compute_seconds", "idle_seconds", "other_seconds", "step_seconds")


class RunTotals:
    def __init__(self, pp: int, microbatches: int, chunks: int):
        self.theory = closed_form(pp, microbatches, chunks)
        self._sums: dict[int, list[float]] = defaultdict(lambda: [0.0] * len(_KEYS))
        self._counts: dict[int, int] = defaultdict(int)
        self._per_step: dict[int, deque] = defaultdict(lambda: deque(maxlen=PER_STEP_KEPT))
        self._skew_sum, self._skew_n = 0.0, 0
        self._ops: dict[tuple, dict] = {}
        self._seen_first = False

    def add_global(self, view: GlobalView | None) -> None:
        if view is None:
            return
        if not self._seen_first:  # warm-up step
            self._seen_first = True
            return
        for s in view.stages:
            sums = self._sums[s.stage]
            for i, key in enumerate(_KEYS):
                sums[i] += getattr(s, key)
            self._counts[s.stage] += 1
            self._per_step[s.stage].append(s.bubble_ratio)
        self._skew_sum += view.pipeline_skew_ratio or 0.0
        self._skew_n += 1

    def add_collectives(self, entries: list[Collective]) -> None:
        for e in entries:
            acc = self._ops.setdefault((e.op, e.group), {"count": 0, "seconds": 0.0, "bytes": 0, "busbw_weighted": 0.0})
            acc["count"] += e.count
            acc["seconds"] += e.seconds
            acc["bytes"] += e.bytes
            acc["busbw_weighted"] += e.busbw * e.seconds

    def as_dict(self) -> dict:
        stages = []
        for stage, sums in sorted(self._sums.items()):
            n = self._counts[stage]
            means = {key: sums[i] / n for i, key in enumerate(_KEYS)}
            # Over the steps too, the bubble is time-weighted (parwatch.bubble), not a mean of ratios.
            means = {"bubble_ratio": stage_bubble(means["idle_seconds"], means["compute_seconds"]), **means}
            stages.append(
                {
                    "stage": stage,
                    **means,
                    "bubble_theoretical_ratio": self.theory,
                    "bubble_ratio_per_step": list(self._per_step[stage]),
                    "steps_measured": n,
                }
            )
        collectives = []
        for (op, group), acc in sorted(self._ops.items()):
            seconds = acc["seconds"]
            collectives.append(
                {
                    "op": op,
                    "group": group,
                    "count": acc["count"],
                    "seconds": seconds,
                    "bytes": acc["bytes"],
                    "mean_seconds": seconds / acc["count"] if acc["count"] else None,
                    "algbw_bytes_per_second": acc["bytes"] / seconds if seconds > 0 else None,
                    "busbw_bytes_per_second": acc["busbw_weighted"] / seconds if seconds > 0 else None,
                }
            )
        return {
            "stages": stages,
            "pipeline_skew_ratio": self._skew_sum / self._skew_n if self._skew_n else None,
            "collectives_rank0": collectives,
        }
