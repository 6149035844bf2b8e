"""Store (latest + window per rank, counters, run changes) and the Observation built from it."""

from __future__ import annotations

import pytest

from parwatch.sidecar.observations import build_observation
from parwatch.sidecar.store import Store
from parwatch.wire.codec import parse
from parwatch.wire.steps import StepSummary
from tests.fixtures import synthetic as syn


class Clock:
    def __init__(self, t=500.0):
        self.t = t

    def __call__(self):
        return self.t


def S(rank, step, **kw) -> StepSummary:
    kw.setdefault("time", float(step))
    return parse(syn.summary(rank, step, **kw), StepSummary)


def test_latest_is_the_newest_by_step():
    store = Store(clock=Clock())
    for step in (1, 2, 4):
        store.add(S(0, step))
    store.add(S(0, 3, time=3.0))  # arrives late
    assert store.ranks[0].summary.step == 4
    assert store.last_step == 4


def TL(rank, step, timeline, **kw) -> StepSummary:
    return parse({**syn.summary(rank, step, **kw), "timeline": timeline}, StepSummary)


def test_a_rollback_moves_the_latest_step_back():
    store = Store(clock=Clock())
    store.add(S(0, 10, time=10.0))
    store.add(TL(0, 6, 1, time=11.0))  # replayed from checkpoint 5: the next timeline
    assert store.ranks[0].summary.step == 6 and store.ranks[0].totals.step_count == 2
    assert store.tokens_total == 2 * 4096  # a replayed step consumes its tokens again


def test_order_and_identity_ignore_the_clients_clock():
    """(timeline, step) orders and identifies; `time` from the future or the past changes nothing."""
    store = Store(clock=Clock())
    stages = [syn.stage_view(0, 1.0, 0.5), syn.stage_view(1, 1.0, 0.7)]
    store.add(S(0, 5, time=1e10, global_stages=stages))  # a clock far in the future
    store.add(S(0, 6, time=1.0, global_stages=stages))  # then a sane one
    assert store.ranks[0].summary.step == 6 and store.global_view.step == 5  # the view of step 5 (step-1)
    # Retries in any order, with any time, are never counted again.
    for step, t in ((5, 3.0), (6, 99.0), (5, 1e10), (4, 0.0), (4, 7.0)):
        store.add(S(0, step, time=t))
    assert store.ranks[0].totals.step_count == 3 and store.tokens_total == 3 * 4096
    assert store.ranks[0].summary.step == 6 and store.global_view.step == 5


def test_retries_older_than_the_remembered_keys_are_not_counted():
    from parwatch.sidecar.store import MAX_KEYS_PER_RANK

    store = Store(clock=Clock())
    for step in range(1, MAX_KEYS_PER_RANK + 10):
        store.add(S(0, step))
    counted = store.ranks[0].totals.step_count
    assert not store.add(S(0, 1)) and not store.add(S(0, MAX_KEYS_PER_RANK + 5))
    assert store.ranks[0].totals.step_count == counted


def test_the_world_is_fixed_at_first_contact_and_ranks_runs_are_bounded():
    from parwatch.sidecar.store import Refused

    clock = Clock()
    store = Store(clock=clock, max_ranks=3, max_runs=2, grace_seconds=5)
    store.admit([S(0, 1, tp=2, pp=2)])
    store.add(S(0, 1, tp=2, pp=2))
    with pytest.raises(Refused, match="fixed by its first summary") as refused:
        store.admit([S(1, 1, tp=8, pp=64, dp=64)])
    assert refused.value.status == 409
    with pytest.raises(Refused, match="--max-ranks 3") as refused:
        store.admit([S(r, 1, tp=2, pp=2) for r in (1, 2, 3)])
    assert refused.value.status == 429 and list(store.ranks) == [0]  # nothing of the post was stored
    with pytest.raises(Refused, match="one post carries one run"):
        store.admit([S(1, 1, tp=2, pp=2), S(1, 1, tp=2, pp=2, run_id="other")])
    with pytest.raises(Refused, match="is live here") as refused:  # a stray post cannot end the live run
        store.admit([S(0, 1, run_id="second")])
    assert refused.value.status == 409
    store.ended = True  # its ranks finished: another run may take over
    store.admit([S(0, 1, run_id="second")])
    store.add(S(0, 1, run_id="second"))
    store.ended = True
    with pytest.raises(Refused, match="--max-runs 2"):
        store.admit([S(0, 1, run_id="third")])
    clock.t += 11  # both earlier runs silent for 2 x grace
    store.admit([S(0, 1, run_id="third")])


def test_a_summary_carries_its_runs_order_and_agrees_with_it():
    """An older summary (no order) is the default order's; coordinates that disagree with the summary's own
    order are refused, named; and one run keeps one order, as it keeps its sizes."""
    from parwatch.sidecar.store import Refused

    megatron = {"stage": 0, "dp_rank": 1, "tp": 1, "pp": 2, "dp": 2}  # rank 1 in Megatron's tp-dp-pp
    with pytest.raises(ValueError, match="rank 1 says tp_rank 0, stage 0, dp_rank 1, but order 'tp-pp-dp'"):
        parse({**syn.summary(1, 1), **megatron}, StepSummary)
    s = parse({**syn.summary(1, 1), **megatron, "order": "tp-dp-pp"}, StepSummary)
    assert s.layout.coords(1) == (0, 0, 1)
    store = Store(clock=Clock())
    store.admit([s])
    store.add(s)
    default = parse(syn.summary(0, 1, dp=2), StepSummary)  # rank 0 sits alike in both: only the order differs
    with pytest.raises(Refused, match="has tp 1 x pp 2 x dp 2 in order tp-dp-pp .* says .* in order tp-pp-dp"):
        store.admit([default])


def test_a_silent_run_is_taken_over_after_the_grace_period():
    """Issue 25, item 4: on 40e8301 one stray rank-0 summary with another run id archived the live run."""
    from parwatch.sidecar.store import Refused

    clock = Clock()
    store = Store(clock=clock, grace_seconds=5)
    store.add(S(0, 1))
    clock.t += 4
    with pytest.raises(Refused, match="posted 4.0 s ago"):
        store.admit([S(0, 1, run_id="stray")])
    clock.t += 2  # silent for 6 s > grace: the run is no longer live
    store.admit([S(0, 1, run_id="next")])


def test_a_new_run_id_starts_over():
    store = Store(clock=Clock())
    store.add(S(0, 5))
    store.add(S(1, 5))
    store.add(S(0, 1, run_id="second"))
    assert store.run_id == "second" and list(store.ranks) == [0] and store.tokens_total == 4096


def test_tokens_count_once_per_step_from_the_lowest_rank():
    store = Store(clock=Clock())
    for step in (1, 2):
        for rank in (3, 1, 2):
            store.add(S(rank, step, tp=2, pp=2))
    # rank 3 came first and counted step 1; from then on rank 1 (the lowest) counts.
    assert store.tokens_total == 2 * 4096


def test_liveness_uses_the_injected_clock():
    clock = Clock()
    store = Store(grace_seconds=5, clock=clock)
    store.add(S(0, 1))
    clock.t += 3
    store.add(S(1, 1))
    clock.t += 3
    assert store.liveness() == {0: False, 1: True}
    assert [r.summary.rank for r in store.visible()] == [0, 1]
    clock.t += 5  # rank 0 silent 11 s > 2 x 5
    assert [r.summary.rank for r in store.visible()] == [1]
    assert store.liveness() == {0: False, 1: False}


def test_observation_carries_the_global_view_and_per_rank_series():
    clock = Clock()
    store = Store(grace_seconds=5, clock=clock)
    stages = [syn.stage_view(0, 1.0, 0.5), syn.stage_view(1, 1.0, 0.7)]
    slow = syn.summary(2, 8, tp=2, pp=2)
    slow["collectives"][0]["seconds"] *= 3  # rank 2's all-reduces take 3x as long
    slow["gpu"]["utilization_ratio"] = 0.3
    store.add(parse(slow, StepSummary))
    store.add(S(1, 8, tp=2, pp=2))
    store.add(S(0, 6, tp=2, pp=2))  # rank 0's process started at step 6: its views of 6 and 7 were its warm-up
    clock.t += 10  # rank 1 goes silent
    store.add(S(0, 9, tp=2, pp=2, global_stages=stages, global_loss=1.5, checkpoints=[4, 8]))
    store.add(parse(slow, StepSummary))
    obs = build_observation(store)
    assert obs.step == 8 and obs.time == clock.t and obs.checkpoints == (4, 8)
    assert obs.series["loss"] == {"": 1.5}
    theory = 1 / 5  # (p-1)/(m+p-1), p=2, m=4
    assert obs.series["bubble_ratio"] == {"stage=0": pytest.approx(0.48 / 0.98), "stage=1": pytest.approx(0.28 / 0.98)}
    assert obs.series["bubble_excess_ratio"]["stage=0"] == pytest.approx(0.48 / 0.98 - theory)
    assert obs.series["pipeline_skew_ratio"] == {"stage=1": pytest.approx(0.7 / 0.6)}  # keyed by the slowest stage
    assert obs.series["step_seconds"] == {"": 1.0}
    assert obs.series["rank_up"] == {"rank=0": 1.0, "rank=1": 0.0, "rank=2": 1.0}
    assert obs.series["collective_seconds_mean"]["op=all_reduce,group=tp"] == pytest.approx(0.006)  # the worst rank
    assert obs.series["gpu_utilization_ratio"] == {"rank=0,gpu=0": 0.9, "rank=2,gpu=2": 0.3}  # not the silent rank


def test_a_process_warm_up_steps_judge_the_loss_not_the_pace():
    clock = Clock()
    store = Store(grace_seconds=5, clock=clock)
    stages = [syn.stage_view(0, 1.0, 0.9), syn.stage_view(1, 1.0, 0.2)]  # a skew of 1.64: stage 0's first steps
    pace = {"bubble_ratio", "bubble_excess_ratio", "step_seconds", "pipeline_skew_ratio"}
    seen = {}
    for step in range(1, 6):
        clock.t += 1
        store.add(P(0, step, 0.5, step - 0.5, global_stages=stages, global_loss=2.0))
        seen[store.global_view.step] = set(build_observation(store).series)
    assert all("loss" in series for series in seen.values())
    assert not pace & (seen[1] | seen[2]) and pace <= seen[3] and pace <= seen[4]
    # A restart (a later process resuming at step 3) warms up again; its loss is judged from its first step.
    clock.t += 1
    store.add(P(0, 3, 5.5, 0.0, time=6.0, global_stages=stages, global_loss=2.0))
    first = build_observation(store)
    assert first.step == 2 and "loss" in first.series and not pace & set(first.series)


def test_no_observation_before_rank_0_sends_the_global_view():
    store = Store(clock=Clock())
    store.add(S(1, 1))
    assert build_observation(store) is None
    store.add(S(0, 1))
    assert build_observation(store) is None


def P(rank, step, started, productive, **kw) -> StepSummary:
    """A summary of the process of `rank` that started at `started`, with its ledger so far."""
    ledger = {"startup": 1.0, "productive": productive, "unattributed": 0.0}
    return parse({**syn.summary(rank, step, **kw), "process_start_time": started, "time_seconds": ledger}, StepSummary)


def test_a_restarted_rank_counts_again_from_where_it_resumed_and_its_ledger_carries_the_down_time():
    store = Store(clock=Clock())
    for step in range(1, 6):
        assert store.add(P(1, step, 1000.0, productive=float(step)))
    store.ended = True  # its ranks crashed (the activity hub said)
    # The restart resumed from checkpoint 3: its step 4 is not a retry, and is the newest again.
    assert store.add(P(1, 4, 1020.0, productive=1.0))
    assert store.ranks[1].summary.step == 4 and not store.ended
    ledger = store.ledgers()[1]
    # The ended process counted 1 + 5 s from t=1000; the new one started at t=1020: 14 s down.
    assert ledger["down"] == pytest.approx(14.0) and ledger["wasted"] == pytest.approx(2.0)
    assert ledger["productive"] == pytest.approx(6.0) and ledger["startup"] == pytest.approx(2.0)
    # A late post of the ended process changes nothing; a collector attached again in the new one
    # (its start computed anew, a few microseconds off) is the same process.
    assert not store.add(P(1, 5, 1000.0, productive=5.0))
    assert store.add(P(1, 5, 1020.0004, productive=2.0))
    assert store.ledgers()[1]["productive"] == pytest.approx(7.0)


def test_a_restarted_rank_0_brings_its_global_view_back_to_the_engine():
    store = Store(clock=Clock())
    stages = [syn.stage_view(0, 0.5, 0.4), syn.stage_view(1, 0.5, 0.4)]
    store.add(P(0, 9, 1000.0, 1.0, global_stages=stages))
    assert store.global_view.step == 8
    store.add(P(0, 7, 1030.0, 1.0, global_stages=stages))
    assert store.global_view.step == 6 and build_observation(store).step == 6
