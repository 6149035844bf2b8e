"""The collector builds its step summary as its record, StepSummary, and sends it as the sidecar reads it:
every summary it sends decodes, on the sidecar's side, into the record it built."""

from __future__ import annotations

import json

from test_collector_sim import pipeline, run_steps

from parwatch.wire.codec import decode, encode
from parwatch.wire.steps import StepSummary


def _summaries(steps=4, **step_kw) -> list[StepSummary]:
    """Every summary of a 2-stage run, as the shipper's thread sends them (its bubble causes added)."""
    run = pipeline(p=2, m=4)
    taken: list[list] = [[] for _ in run.ranks]
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_summary = lambda s, delivery=None, view=None, r=r: taken[r].append((s, view))
    losses = {3: float("nan")}
    run_steps(run, steps, 0.1, loss=lambda step: losses.get(step, 2.5), **step_kw)
    return [rank.collector._prepare(s, view) for rank, sent in zip(run.ranks, taken) for s, view in sent]


def test_every_summary_the_collector_builds_is_the_record_the_sidecar_reads():
    summaries = _summaries(dp_sync=0.004, tp_allreduce=0.001)
    assert len(summaries) >= 4 and any(s.global_ for s in summaries)  # rank 0's global view is there
    assert any(s.collectives for s in summaries) and all(s.instances and s.time_seconds for s in summaries)
    for summary in summaries:
        assert decode(encode(summary), StepSummary) == summary
    nan_step = [s for s in summaries if s.step == 3]
    assert nan_step and all(json.loads(encode(s))["loss"] == "nan" for s in nan_step)
