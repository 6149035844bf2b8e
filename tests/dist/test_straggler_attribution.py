"""A slow stage, named by the numbers: `--inject straggler:stage=k,ms=X` through trainer and collector.

The straggler sleeps X ms inside every forward of stage k, so that stage's compute per
microbatch rises by X; the pipeline then runs at its pace and the other stages wait for
it: their idle rises (by m*X per step at p=2) while stage k's does not. The skew ratio
(max stage compute / mean) becomes (c + m*X) / mean. Read from every rank's step
summaries (summaries.jsonl, --parwatch-log) and rank 0's run summary (--summary-json
"stages", "pipeline_skew_ratio"), each run against the same run without the fault.

Exact figures come from medians over the steps after the first: on this shared 2-core
machine a step now and then loses 40-80 ms to another process (seen on a stage that
does not straggle), which moves a 4-step mean by up to 5 ms per microbatch.
"""

from __future__ import annotations

import statistics

import pytest

from tests.dist.test_bubble_fidelity import (
    BWD_MS,
    FWD_MS,
    pipeline_run,
    read_run,
    train_runs,
)
from tests.distutil import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

M = 4
X_MS = 20.0
STEPS = 10  # 8 measured: medians that ride out a burst of load over a few steps
LATE_FROM = 6  # the late straggler starts at step 6
CASES = {2: 1, 4: 2}  # pipeline stages -> the straggling stage
# Observed rise in compute per microbatch: 19.6-20.4 ms for X = 20 (medians); 10% = 2 ms.
COMPUTE_REL = 0.10
# Observed idle rise vs the ideal schedule's: within 1-6 ms (of 60-80 ms); 12 ms = 15% of
# m*X leaves room for slow wake-ups while still telling +m*X from +(m-1)*X.
IDLE_TOLERANCE_S = 0.15 * M * X_MS / 1000


def runs_for(p: int, k: int) -> dict:
    fault = f"straggler:stage={k},ms={X_MS:g}"
    runs = {
        f"p{p}-baseline": pipeline_run(p, M, steps=STEPS),
        f"p{p}-straggler": pipeline_run(p, M, steps=STEPS, inject=[fault]),
    }
    if p == 2:  # one case also shows from when
        runs["p2-late"] = pipeline_run(p, M, steps=STEPS, inject=[f"{fault},from_step={LATE_FROM}"])
    return runs


def own_medians(steps: list[dict], key: str, p: int) -> list[float]:
    """Each rank's own step summaries: per stage, the median of `key` over steps 2.. ."""
    return [statistics.median(s[key] for s in steps if s["stage"] == stage and s["step"] >= 2) for stage in range(p)]


def view_skews(steps: list[dict]) -> list[float]:
    """Rank 0's per-step global views (one step late): pipeline_skew_ratio of steps 2.. ."""
    return [
        s["global"]["pipeline_skew_ratio"]
        for s in steps
        if s["rank"] == 0 and s["global"] is not None and s["global"]["step"] >= 2
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("straggler")
    names = []
    for p, k in CASES.items():
        batch = runs_for(p, k)
        run_ranks(train_runs, p, batch, str(out), timeout=100)
        names += batch
    found = {name: read_run(out, name) for name in names}
    print()
    for p in CASES:
        for kind in ("baseline", "straggler"):
            summary, steps = found[f"p{p}-{kind}"]
            per_mb = " ".join(f"{c / M * 1000:.2f}" for c in own_medians(steps, "compute_seconds", p))
            idle = " ".join(f"{x * 1000:.1f}" for x in own_medians(steps, "idle_seconds", p))
            print(
                f"p={p} {kind:>9}: compute ms/microbatch [{per_mb}]  idle ms/step [{idle}]  skew per step "
                f"median {statistics.median(view_skews(steps)):.4f} mean {summary['pipeline_skew_ratio']:.4f}"
            )
    late = sorted((s["stage"], s["step"], s["compute_seconds"]) for s in found["p2-late"][1])
    for stage in range(2):
        per_mb = " ".join(f"{c / M * 1000:.2f}" for st, _, c in late if st == stage)
        print(f"p=2 late straggler (from step {LATE_FROM}), stage {stage} compute ms/microbatch by step: {per_mb}")
    return found


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_the_straggling_stage_computes_x_more_per_microbatch(runs, p, k):
    base = own_medians(runs[f"p{p}-baseline"][1], "compute_seconds", p)
    slow = own_medians(runs[f"p{p}-straggler"][1], "compute_seconds", p)
    rises_ms = [(b - a) / M * 1000 for a, b in zip(base, slow)]
    expected = [X_MS if stage == k else 0.0 for stage in range(p)]
    assert rises_ms == pytest.approx(expected, abs=COMPUTE_REL * X_MS), (base, slow)


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_within_the_run_the_straggler_computes_x_more_than_the_others(runs, p, k):
    slow = own_medians(runs[f"p{p}-straggler"][1], "compute_seconds", p)
    others = statistics.median(c for s, c in enumerate(slow) if s != k)
    assert (slow[k] - others) / M * 1000 == pytest.approx(X_MS, rel=COMPUTE_REL), slow


@pytest.mark.parametrize("p,k", CASES.items())
def test_the_run_totals_name_the_straggling_stage(runs, p, k):
    totals = [s["compute_seconds"] for s in runs[f"p{p}-straggler"][0]["stages"]]
    assert max(range(p), key=totals.__getitem__) == k, totals


def ideal_idle(p: int, k: int, extra_fwd: float) -> list[float]:
    """Each stage's idle seconds per step on an ideal machine (no latency), stage k's forwards
    extra_fwd longer: the 1F1B lists the executor runs, replayed by parwatch.pipeline_sim."""
    from parwatch import pipeline_sim as ps
    from parwatch.trainer.schedules import pipeline_order

    durations = {"F": FWD_MS / 1000, "B": BWD_MS / 1000, (k, "F"): FWD_MS / 1000 + extra_fwd}
    idle = ps.simulate(pipeline_order("1f1b", p, M), durations).idle
    return [idle[s] for s in range(p)]


def predicted_rise(p: int, k: int) -> list[float]:
    return [a - b for a, b in zip(ideal_idle(p, k, X_MS / 1000), ideal_idle(p, k, 0.0))]


@pytest.mark.parametrize("p,k", CASES.items())
def test_the_schedule_makes_the_others_wait_at_least_m_minus_1_x(p, k):
    """Idle moves as the schedule says: up on the others, not on stage k (p=2: +m*X on stage 0;
    p=4, k=2, m=4: +(m-1)*X on the others and -X on stage 2, whose own gaps absorb some of it)."""
    predicted = predicted_rise(p, k)
    assert all(predicted[stage] >= (M - 1) * X_MS / 1000 - 1e-9 for stage in range(p) if stage != k), predicted


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_the_other_stages_wait_for_it(runs, p, k):
    base = own_medians(runs[f"p{p}-baseline"][1], "idle_seconds", p)
    slow = own_medians(runs[f"p{p}-straggler"][1], "idle_seconds", p)
    rises = [b - a for a, b in zip(base, slow)]
    assert rises == pytest.approx(predicted_rise(p, k), abs=IDLE_TOLERANCE_S), (base, slow)


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_step_by_step_the_others_wait_longer_than_the_straggler(runs, p, k):
    """Within the straggler run, step by step: how much longer each stage waits than stage k. A burst
    of load lengthens a step for every stage alike, so it cancels here."""
    ideal = ideal_idle(p, k, X_MS / 1000)
    idle = {(s["stage"], s["step"]): s["idle_seconds"] for s in runs[f"p{p}-straggler"][1] if s["step"] >= 2}
    others = sorted(set(range(p)) - {k})
    gaps = [statistics.median(idle[(stage, n)] - idle[(k, n)] for n in range(2, STEPS + 1)) for stage in others]
    assert gaps == pytest.approx([ideal[stage] - ideal[k] for stage in others], abs=IDLE_TOLERANCE_S)


@pytest.mark.parametrize("p,k", CASES.items())
def test_the_stage_that_waits_least_is_the_straggler(runs, p, k):
    bubbles = [statistics.median(s["bubble_ratio_per_step"]) for s in runs[f"p{p}-straggler"][0]["stages"]]
    assert min(range(p), key=bubbles.__getitem__) == k, bubbles


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_a_healthy_pipeline_has_no_skew(runs, p, k):
    assert statistics.median(view_skews(runs[f"p{p}-baseline"][1])) == pytest.approx(1.0, abs=0.03)


def predicted_skew(runs: dict, p: int, k: int) -> float:
    expected = own_medians(runs[f"p{p}-baseline"][1], "compute_seconds", p)
    expected[k] += M * X_MS / 1000
    return max(expected) / statistics.fmean(expected)  # (c + m*X) / mean


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_pipeline_skew_ratio_shows_it(runs, p, k):
    # The excess over 1 is what a guardrail thresholds: it must be close, not just the ratio.
    skew = statistics.median(view_skews(runs[f"p{p}-straggler"][1]))
    assert skew - 1 == pytest.approx(predicted_skew(runs, p, k) - 1, rel=0.15)


@pytest.mark.timing
@pytest.mark.parametrize("p,k", CASES.items())
def test_the_run_summarys_skew_is_the_mean_of_the_same_ratios(runs, p, k):
    assert runs[f"p{p}-straggler"][0]["pipeline_skew_ratio"] == pytest.approx(predicted_skew(runs, p, k), rel=0.10)


def late_compute(runs: dict) -> dict:
    return {(s["stage"], s["step"]): s["compute_seconds"] for s in runs["p2-late"][1]}


@pytest.mark.timing
def test_step_summaries_show_which_stage_slows_from_when(runs):
    """Every rank's own summaries: stage 1's compute rises by m*X from the step the fault begins."""
    p, k = 2, CASES[2]
    compute = late_compute(runs)
    rises_ms = []
    for stage in range(p):
        before = [compute[(stage, n)] for n in range(2, LATE_FROM)]
        after = [compute[(stage, n)] for n in range(LATE_FROM, STEPS + 1)]
        rises_ms.append((statistics.median(after) - statistics.median(before)) / M * 1000)
    assert rises_ms == pytest.approx([X_MS if stage == k else 0.0 for stage in range(p)], abs=COMPUTE_REL * X_MS)


@pytest.mark.timing
def test_the_straggler_shows_from_that_very_step_not_one_earlier(runs):
    """Half the jump: a single step can lose a few ms."""
    k, compute = CASES[2], late_compute(runs)
    before = statistics.median(compute[(k, n)] for n in range(2, LATE_FROM))
    jumps = [compute[(k, LATE_FROM - 1)] - before, compute[(k, LATE_FROM)] - before]
    assert jumps[0] < M * X_MS / 1000 / 2 < jumps[1], jumps


@pytest.mark.timing
def test_rank0s_view_sees_the_skew_appear_with_it(runs):
    """Rank 0's per-step global view (one step late) sees the skew appear with the straggler."""
    views = runs["p2-late"][1]
    skews = {s["global"]["step"]: s["global"]["pipeline_skew_ratio"] for s in views if s["rank"] == 0 and s["global"]}
    before = statistics.median(skews[n] for n in range(2, LATE_FROM))
    after = statistics.median(skews[n] for n in range(LATE_FROM, STEPS))
    assert before < 1.03 and after > 1.10, (before, after)
