from parwatch.collector.run_totals import PER_STEP_KEPT, RunTotals
from parwatch.vocabulary import CollectiveOp, GroupRole
from parwatch.wire.steps import Collective, GlobalStage, GlobalView


def _view(step, bubbles, computes, skew):
    return GlobalView(
        step=step,
        pipeline_skew_ratio=skew,
        stages=[
            GlobalStage(
                stage=i,
                bubble_ratio=b,
                compute_seconds=c,
                idle_seconds=c * b / (1 - b),
                other_seconds=0.0,
                step_seconds=c / (1 - b),
            )
            for i, (b, c) in enumerate(zip(bubbles, computes))
        ],
    )


def test_means_leave_out_the_warm_up_step_and_report_theory():
    t = RunTotals(pp=2, microbatches=4, chunks=1)
    t.add_global(_view(1, [0.9, 0.9], [1.0, 1.0], 5.0))  # warm-up: ignored
    t.add_global(_view(2, [0.2, 0.3], [1.0, 2.0], 1.2))
    t.add_global(_view(3, [0.4, 0.5], [3.0, 4.0], 1.4))
    t.add_global(None)
    d = t.as_dict()
    s0, s1 = d["stages"]
    # Time-weighted over the steps (parwatch.bubble): stage 0 idles 0.25 s of 1.25, then 2 s of 5.
    assert abs(s0["bubble_ratio"] - 2.25 / 6.25) < 1e-12
    assert abs(s1["bubble_ratio"] - (6 / 7 + 4) / (6 / 7 + 4 + 6)) < 1e-12
    assert abs(s1["compute_seconds"] - 3.0) < 1e-12
    assert s0["bubble_theoretical_ratio"] == 0.2 and s0["steps_measured"] == 2
    assert s0["bubble_ratio_per_step"] == [0.2, 0.4]
    assert abs(d["pipeline_skew_ratio"] - 1.3) < 1e-12


def test_collective_totals_and_bounded_history():
    t = RunTotals(pp=2, microbatches=1, chunks=1)
    for step in range(PER_STEP_KEPT + 10):
        t.add_global(_view(step, [0.5, 0.5], [1.0, 1.0], 1.0))
    ar, tp = CollectiveOp.ALL_REDUCE, GroupRole.TP
    t.add_collectives([Collective(op=ar, group=tp, count=2, seconds=0.5, bytes=100, busbw=100.0)])
    t.add_collectives([Collective(op=ar, group=tp, count=2, seconds=1.5, bytes=300, busbw=300.0)])
    d = t.as_dict()
    assert len(d["stages"][0]["bubble_ratio_per_step"]) == PER_STEP_KEPT
    (c,) = d["collectives_rank0"]
    assert c["count"] == 4 and c["bytes"] == 400 and c["mean_seconds"] == 0.5
    assert c["algbw_bytes_per_second"] == 200.0 and c["busbw_bytes_per_second"] == 250.0
