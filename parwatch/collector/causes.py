"""The bubble split into its causes, for rank 0's global view (run on the shipper's thread).

Per stage and step (parwatch.pipeline_sim.bubble_causes): `schedule` is the bubble the
schedule itself implies with every stage at this step's mean per-action times, `imbalance`
what this step's measured per-stage times add to it, `wait` the rest of the measured bubble
(p2p, collectives, host). Replaying a schedule costs O(actions), so it never runs on the
training thread: the shipper calls `with_causes` before it writes or sends a summary.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec.structs import replace

from parwatch.bubble import replayed_theory
from parwatch.pipeline_sim import Replay, bubble_causes, per_action_seconds
from parwatch.wire.steps import GlobalView


class CauseSplitter:
    """Holds the run's pipeline order (from the trainer's run_start event) and enriches summaries."""

    def __init__(self) -> None:
        self.order: Replay | None = None
        """The run's order, compiled once (replayed twice per step)."""
        self.errors = 0
        """Summaries whose causes could not be computed (a partial view, an order that does not replay)."""

    def set_order(self, order: Mapping | None) -> float | None:
        """Keep the order; returns its schedule bubble at equal action times (None if it does not replay).

        That is the theoretical bubble of schedules without a closed form (zero-bubble, V shapes)."""
        if not order:
            return None
        try:
            replay = Replay({int(rank): list(actions) for rank, actions in order.items()})
            theory = replayed_theory(replay)
        except (ValueError, TypeError, KeyError):
            self.errors += 1
            return None
        self.order = replay
        return theory

    def with_causes(self, view: GlobalView) -> GlobalView:
        """The view with every stage's bubble split into its causes (BubbleCause), or as it is when it cannot be."""
        if self.order is None or not view.stages:
            return view
        stages = {s.stage: s for s in view.stages}
        if set(stages) != set(self.order.ranks):
            return view  # a stage did not report this step: no replay of a partial pipeline
        try:
            causes = bubble_causes(
                self.order, per_action_seconds(self.order, stages), {st: s.bubble_ratio for st, s in stages.items()}
            )
        except (ValueError, ZeroDivisionError):
            self.errors += 1
            return view
        split = [
            replace(s, **{cause.ratio_field: ratio for cause, ratio in causes[s.stage].as_dict().items()})
            for s in view.stages
        ]
        return replace(view, stages=split)
