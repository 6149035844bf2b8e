"""Memory stays flat: 4,000 synthetic steps leave the collector's buffers the size they were
(benchmarks/collector_memory.py runs 10,000 steps of the real trainer)."""

from __future__ import annotations

import gc
import time
import tracemalloc

from test_collector_sim import SimRank, SimRun, ctx_for, run_steps

from parwatch.collector import SpanSampling

STEPS = 4_000
SPANS_PER_STEP = 4 + 4 + 4 + 2 + 1 + 1  # fwd, tp all_reduce, bwd, dp_sync + its all_reduce, optimizer, boundary


class CountingPoster:
    """A sidecar that accepts everything and keeps nothing but a count."""

    def __init__(self) -> None:
        self.summaries = 0

    def post(self, url, content, headers):
        self.summaries += content.count(b'"run_id"')
        return _Reply()


class _Reply:
    status_code = 200
    text = ""

    def json(self):
        return {
            "accepted": 1,
            "directive": {"id": 1, "action": "resume", "run_id": "sim-run", "to_step": None, "skip_batches": 0},
        }


def drained(collector, poster: CountingPoster) -> None:
    """Wait until every summary not displaced from the full queue has been posted."""
    deadline = time.monotonic() + 60
    while poster.summaries < collector.summaries - collector.dropped_total or collector.shipper.queued():
        assert time.monotonic() < deadline, "shipper did not catch up within 60 s"
        time.sleep(0.01)
    time.sleep(0.05)  # let the shipper thread drop its last batch's references


def test_four_thousand_steps_keep_buffers_bounded_and_memory_flat(tmp_path):
    poster = CountingPoster()
    rank = SimRank(
        ctx_for(0, pp=1, m=4),
        endpoint="http://sidecar.invalid",
        http=poster,
        queue_size=64,
        log_path=str(tmp_path / "summaries.jsonl"),
        spans_path=str(tmp_path / "spans.jsonl"),
        span_sample_steps=SpanSampling(first=5, every=50),
    )
    run = SimRun([rank])
    collector = rank.collector
    step_kw = dict(tp_allreduce=0.001, dp_sync=0.004)
    run.boundary(0, "start", 0.0, 0.1)
    t = run_steps(run, 200, 0.1, **step_kw)
    tracemalloc.start()
    try:
        drained(collector, poster)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        step = 201
        for _chunk in range(STEPS // 100):
            t = run_steps(run, 100, t, first_step=step, **step_kw)
            step += 100
            rank.registry.emit_event("checkpoint_saved", step=step - 1)
            # the buffers a leak would live in, checked along the way
            assert collector._pending == [] and len(collector._stats.ops) <= 3
            assert collector._records is None or len(collector._records) <= SPANS_PER_STEP
            assert collector.shipper.queued() <= 64
        drained(collector, poster)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert collector.summaries == STEPS + 200
    assert len(collector.last_summary.checkpoints) == 20
    assert len(collector.directives._taken) <= 256
    # a leak of one small object per span would be > 640 KB over 64,000 spans
    assert growth < 256 * 1024, f"traced memory grew by {growth} bytes over {STEPS} steps"
    collector.close(timeout=30)
    with open(tmp_path / "summaries.jsonl") as f:
        # every summary that was not displaced from the full queue was written (the poster never fails)
        assert sum(1 for _ in f) == collector.summaries - collector.dropped_total
