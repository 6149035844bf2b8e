"""Whole-run figures rank 0 adds to the trainer's --summary-json at the end of a run.

Built from the fast-path global views (every stage, one step of lag) and this
rank's own collective statistics. The first measured step is left out of the
means: it carries one-off warm-up (allocator, first gloo connections).
"""

from __future__ import annotations

from collections import defaultdict

from parwatch.schema import bubble_theoretical_ratio


class RunTotals:
    def __init__(self, pp: int, microbatches: int, chunks: int):
        self.theory = bubble_theoretical_ratio(pp, microbatches, chunks)
        self._stage_steps: dict[int, list[dict]] = defaultdict(list)
        self._skew: list[float] = []
        self._ops: dict[tuple, dict] = {}
        self._seen_first = False

    def add_global(self, view: dict | None) -> None:
        if not view:
            return
        if not self._seen_first:  # warm-up step
            self._seen_first = True
            return
        for s in view["stages"]:
            self._stage_steps[s["stage"]].append(s)
        self._skew.append(view["pipeline_skew_ratio"])

    def add_collectives(self, entries: list[dict]) -> None:
        for e in entries:
            acc = self._ops.setdefault((e["op"], e["group"]), {"count": 0, "seconds": 0.0, "bytes": 0,
                                                               "busbw_weighted": 0.0})
            acc["count"] += e["count"]
            acc["seconds"] += e["seconds"]
            acc["bytes"] += e["bytes"]
            acc["busbw_weighted"] += (e.get("busbw") or 0.0) * e["seconds"]

    def as_dict(self) -> dict:
        stages = []
        for stage, steps in sorted(self._stage_steps.items()):
            n = len(steps)
            mean = lambda key: sum(s[key] for s in steps) / n  # noqa: E731
            stages.append({
                "stage": stage,
                "bubble_ratio": mean("bubble_ratio"),
                "bubble_theoretical_ratio": self.theory,
                "compute_seconds": mean("compute_seconds"),
                "idle_seconds": mean("idle_seconds"),
                "other_seconds": mean("other_seconds"),
                "step_seconds": mean("step_seconds"),
                "bubble_ratio_per_step": [s["bubble_ratio"] for s in steps],
                "steps_measured": n,
            })
        collectives = []
        for (op, group), acc in sorted(self._ops.items()):
            seconds = acc["seconds"]
            collectives.append({
                "op": op, "group": group, "count": acc["count"], "seconds": seconds, "bytes": acc["bytes"],
                "mean_seconds": seconds / acc["count"] if acc["count"] else None,
                "algbw_bytes_per_second": acc["bytes"] / seconds if seconds > 0 else None,
                "busbw_bytes_per_second": acc["busbw_weighted"] / seconds if seconds > 0 else None,
            })
        return {
            "stages": stages,
            "pipeline_skew_ratio": sum(self._skew) / len(self._skew) if self._skew else None,
            "collectives_rank0": collectives,
        }

