"""Hang analysis over activity pictures: who is the culprit, who waits, crash vs hang, and the leader
naming one hung rank among 16,384 simulated ranks from node digests."""

import msgspec
import pytest
from msgspec.structs import astuple, replace

from parwatch.catalog import RANK_STATES
from parwatch.rank_layout import RankLayout
from parwatch.sidecar.digest import BadActivity, LeaderView, NodeBook
from parwatch.sidecar.hang import (
    FIRST_FORWARD_SECONDS,
    JUDGE_EVERY_SECONDS,
    MAX_REPORT_LATENCY_SECONDS,
    Activity,
    HangMonitor,
    HangSettings,
    Progress,
    find_culprit,
)
from parwatch.vocabulary import SpanKind
from parwatch.wire.activity import NodeDigest
from parwatch.wire.findings import Coverage, Missing, NodeMissing


def act(
    rank,
    layout,
    kind=None,
    op=None,
    group=None,
    peer=None,
    seq=None,
    step=4,
    state="running",
    since=100.0,
    host="h0",
    time=1e10,
):
    at = layout.coords(rank)
    return Activity(
        rank,
        state,
        kind,
        op,
        group,
        peer,
        seq,
        since,
        step,
        0.1,
        1000 + rank,
        host,
        at.stage,
        at.tp_rank,
        at.dp_rank,
        time,
        None,
    )


class FakeEngine:
    def __init__(self):
        self.records = []

    def record_finding(self, rule, action, reason, evidence, step, bundle=None):
        evidence = msgspec.to_builtins(evidence)  # the engine's record holds the evidence as written
        record = {"rule": rule, "action": action, "reason": reason, "evidence": evidence, "step": step}
        if bundle is not None:
            evidence["bundle"] = f"evidence/{bundle or 'run'}/decision-{len(self.records)}"
        self.records.append(record)
        return record


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_recv_chain_names_the_rank_in_compute():
    lay = RankLayout(1, 4, 1)
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=1),
        1: act(1, lay, "recv", "recv", "pp", peer=2),
        2: act(2, lay, "forward"),
        3: act(3, lay, "recv", "recv", "pp", peer=2),
    }
    found = find_culprit(rows, lay)
    assert found["culprit"] == 2 and found["waiting"] == [0, 1, 3] and found["method"] == "dependency"


def test_a_rank_blocked_in_a_send_waits_for_its_peer():
    """DeepSpeed's DualPipeV commits a send-only batch and blocks in it (gloo completes a send as the peer
    receives): the rank that sends to the hung one is one of its waiters, and the finding says so."""
    from parwatch.sidecar.hang import _missing_text

    lay = RankLayout(1, 2, 1)
    rows = {0: act(0, lay, "send", "send", "pp", peer=1), 1: act(1, lay, "forward")}
    found = find_culprit(rows, lay)
    assert found["culprit"] == 1 and found["waiting"] == [0]
    assert _missing_text(found["missing"]) == "; rank 0 waits in a send to it"
    rows[0] = act(0, lay, "recv", "recv", "pp", peer=1)
    assert _missing_text(find_culprit(rows, lay)["missing"]) == "; rank 0 waits in a recv from it"
    # A rank stuck in its send while the peer waits in the matching receive is the one the data is not
    # leaving: the culprit (the trainer's where=send hang), not a cycle.
    rows = {0: act(0, lay, "recv", "recv", "pp", peer=1, since=50.0), 1: act(1, lay, "send", "send", "pp", peer=0)}
    found = find_culprit(rows, lay)
    assert found["culprit"] == 1 and found["waiting"] == [0] and found["method"] == "dependency"


def test_tp_collective_names_the_member_that_has_not_joined():
    lay = RankLayout(2, 2, 1)  # ranks 0,1 stage 0; 2,3 stage 1
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=2),
        1: act(1, lay, "recv", "recv", "pp", peer=3),
        2: act(2, lay, "collective", "all_reduce", "tp", seq=7),
        3: act(3, lay, "forward"),
    }
    found = find_culprit(rows, lay)
    assert found["culprit"] == 3
    assert found["waiting"] == [0, 1, 2]
    assert found["missing"] == Missing(kind=SpanKind.COLLECTIVE, op="all_reduce", group="tp", seq=7)


def test_a_member_in_an_earlier_collective_is_behind():
    lay = RankLayout(2, 1, 1)
    rows = {
        0: act(0, lay, "collective", "all_reduce", "tp", seq=8),
        1: act(1, lay, "collective", "all_reduce", "tp", seq=7),
    }
    found = find_culprit(rows, lay)
    # Each waits in a different collective: a mismatch, both blocked; the longest open is named.
    assert found["culprit"] in (0, 1)


def test_boundary_collective_without_seq_lines_up_by_step():
    lay = RankLayout(1, 2, 2)  # ranks 0,1 replica 0; 2,3 replica 1
    rows = {r: act(r, lay, "collective", "all_reduce", "world") for r in (0, 1, 3)}
    rows[2] = act(2, lay, "backward")
    found = find_culprit(rows, lay)
    assert found["culprit"] == 2 and found["waiting"] == [0, 1, 3]


def test_groups_are_the_runs_order_not_the_default():
    """Megatron's default order (tp-dp-pp): DP replicas inside the pipeline. Rank 0's DP all-reduce waits
    for rank 1 (its replica peer here), where the default order would have it wait for rank 2."""
    lay = RankLayout(1, 2, 2, "tp-cp-ep-dp-pp")
    rows = {
        0: act(0, lay, "collective", "all_reduce", "dp", seq=3),
        1: act(1, lay, "forward"),
        2: act(2, lay, "collective", "all_reduce", "dp", seq=3),
        3: act(3, lay, "collective", "all_reduce", "dp", seq=3),
    }
    found = find_culprit(rows, lay)
    assert found["culprit"] == 1 and found["waiting"] == [0], found
    assert find_culprit(rows, RankLayout(1, 2, 2))["culprit"] != 1  # read in the wrong order: the wrong rank


def test_a_gradient_sync_that_names_its_group_waits_for_it():
    """Megatron's finalize_model_grads (dp_sync, group dp): TP1 x PP2 x DP2 in tp-dp-pp, rank 3 hung in
    its forward. Rank 1 (its pipeline) waits in a receive; ranks 0 and 2 finished their replica's pipeline
    and wait in the DP all-reduce for ranks 1 and 3; without a group a dp_sync waits for nobody."""
    lay = RankLayout(1, 2, 2, "tp-dp-pp")
    sync = {"kind": "dp_sync", "op": "finalize_model_grads", "group": "dp"}
    rows = {
        0: act(0, lay, **sync),
        1: act(1, lay, "recv", "recv", "pp", peer=3),
        2: act(2, lay, **sync),
        3: act(3, lay, "forward"),
    }
    assert find_culprit(rows, lay) == {
        "culprit": 3,
        "waiting": [0, 1, 2],
        "missing": Missing(kind=SpanKind.COLLECTIVE, op="finalize_model_grads", group="dp", seq=None),
        "method": "dependency",
        "kind": "host",
        "kind_waits_on": [],
        "waits_on": {0: [1], 1: [3], 2: [3]},
    }
    rows[0], rows[2] = act(0, lay, "dp_sync"), act(2, lay, "dp_sync")
    assert find_culprit(rows, lay)["waiting"] == [1]


def test_send_hang_is_named_with_its_peer():
    lay = RankLayout(1, 2, 1)
    rows = {0: act(0, lay, "send", "send", "pp", peer=1), 1: act(1, lay, "recv", "recv", "pp", peer=0)}
    assert find_culprit(rows, lay)["culprit"] == 0


def test_nobody_waiting_names_the_oldest_span():
    lay = RankLayout(1, 2, 1)
    rows = {0: act(0, lay, "forward", since=50.0), 1: act(1, lay, "backward", since=60.0)}
    assert find_culprit(rows, lay) == {
        "culprit": 0,
        "waiting": [],
        "missing": None,
        "method": "oldest-span",
        "kind": "host",
        "kind_waits_on": [],
        "waits_on": {},
    }


def test_progress_bound_is_1_4_medians_or_2_75_seconds_under_the_named_within_goal():
    """Issue 44: a hang named within max(1.5 x median step, 3 s); the wake-up and transit come after the bound."""
    p = Progress(HangSettings())
    assert p.bound() == 60.0  # start-up (warm-up, compilation): the busy bound, no step yet
    for step in range(1, 20):
        p.observe(step, 5.0, float(step))
    assert p.bound() == 7.0 and p.busy_bound() == 100.0  # 1.4 and 20 median steps
    p2 = Progress(HangSettings())
    p2.observe(1, 0.1, 0.0)
    assert p2.bound() == 2.75 and p2.busy_bound() == 60.0
    p3 = Progress(HangSettings(min_seconds=10, step_factor=3))
    p3.observe(1, 0.1, 0.0)
    assert p3.bound() == 10.0


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="hang-min-seconds"):
        HangSettings(min_seconds=0)
    with pytest.raises(ValueError, match="hang-step-factor"):
        HangSettings(step_factor=0.5)
    with pytest.raises(ValueError, match="hang-busy-seconds"):
        HangSettings(busy_seconds=1.0)


TEN_SECONDS = HangSettings(min_seconds=10.0, step_factor=3.0)
"""The bound these timelines were written for (the default until issue 44): the mechanism, not the default."""


def _monitor(settings: HangSettings = TEN_SECONDS):
    clock, engine = Clock(), FakeEngine()
    return HangMonitor(settings, engine, clock), clock, engine


def test_healthy_steps_make_no_finding():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 201):  # 200 healthy steps of 50 ms, checked every 20 steps (once a second)
        clock.t += 0.05
        for r in (0, 1):
            monitor.observe(act(r, lay, "forward", step=step), lay, clock.t)
        if step % 20 == 0:
            assert monitor.check({r: act(r, lay, "forward", step=step) for r in (0, 1)}) == []
    assert engine.records == [] and not monitor.hang_detected


def _rank_1_stalls(monitor, clock) -> dict:
    """Rank 0 reports steps 1-5 a second apart; the picture then: rank 0 waits in a recv from rank 1, which
    has been in its forward since step 5 (rank 0's newest sample, not the ones observed: it keeps reporting)."""
    lay = RankLayout(1, 2, 1)
    for step in range(1, 6):
        clock.t += 1.0
        monitor.observe(act(0, lay, "forward", step=step, time=clock.t), lay, clock.t)
    return {0: act(0, lay, "recv", "recv", "pp", peer=1, step=5), 1: act(1, lay, "forward", step=5, since=1004.0)}


def test_hang_is_recorded_once_per_episode_and_ends_with_progress():
    monitor, clock, engine = _monitor()
    rows = _rank_1_stalls(monitor, clock)
    clock.t += 9.0
    assert monitor.check(rows) == []  # 9 s < 10 s
    clock.t += 1.5
    [record] = monitor.check(rows)
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1
    assert record["evidence"]["culprit"]["kind"] == "forward" and record["evidence"]["waiting"] == [0]
    assert set(record["evidence"]["culprit"]) >= {"rank", "stage", "host", "kind", "op", "since"}
    assert monitor.rank_states(rows) == {0: 0, 1: 1} and monitor.hang_detected
    clock.t += 5
    assert monitor.check(rows) == []  # the same episode: recorded once
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, "forward", step=6), lay, clock.t)
    assert not monitor.hang_detected


def test_a_named_hang_is_not_searched_for_again_while_it_lasts(monkeypatch):
    """The culprit search reads every rank (~30 ms at 16,384 on the leader's event loop): once the episode's
    hang is named, the checks that follow until progress resumes do not run it again."""
    import parwatch.sidecar.hang as hang

    searches = []
    search = hang.Waits.culprit
    monkeypatch.setattr(hang.Waits, "culprit", lambda *a: searches.append(1) or search(*a))
    monitor, clock, engine = _monitor()
    rows = _rank_1_stalls(monitor, clock)
    clock.t += 10.5
    [record] = monitor.check(rows)
    assert record["rule"] == "hang" and len(searches) == 1
    for _ in range(8):
        clock.t += 0.25
        assert monitor.check(rows) == []
    assert len(searches) == 1


def test_crash_is_told_from_a_hang():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    rows = {0: act(0, lay, "recv", "recv", "pp", peer=1, step=3), 1: act(1, lay, "forward", step=3, state="gone")}
    [record] = monitor.check(rows)  # at once: no need to wait for the hang bound
    assert record["rule"] == "rank-gone" and record["evidence"]["culprit"]["rank"] == 1
    assert record["evidence"]["culprit"]["state"] == "gone"
    assert monitor.rank_states(rows)[1] == 2
    clock.t += 100
    assert [r["rule"] for r in monitor.check(rows)] == []  # neither again, nor a hang of a gone rank


def test_paused_runs_do_not_hang():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    clock.t += 500
    assert monitor.check({0: act(0, lay, step=3), 1: act(1, lay, step=3)}, paused=True) == []


def test_node_book_liveness_pid_and_silence():
    clock = Clock()
    alive = {1000: True, 1001: False}
    book = NodeBook(clock, silent_seconds=5.0, hostname="h0", alive=lambda pid: alive.get(pid, True))
    lay = RankLayout(1, 3, 1)
    for r in range(3):
        book.add(act(r, lay, "forward"), lay, "run")
    book.add(act(2, lay, state="done"), lay, "run")
    rows = book.rows()
    assert (rows[0].state, rows[1].state, rows[2].state) == ("running", "gone", "done")
    clock.t += 6
    assert book.rows()[0].state == "silent"  # pid alive, no reports: frozen, not gone


def test_leader_names_one_hung_rank_among_16384_from_digests():
    lay = RankLayout(8, 16, 128)
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(TEN_SECONDS, engine, clock)
    view = LeaderView(clock)
    hung = 9_001
    per_node = 8

    def digests(step, hanging):
        for node in range(lay.world // per_node):
            rows = []
            for r in range(node * per_node, (node + 1) * per_node):
                a = act(r, lay, "forward", step=step, host=f"n{node}", time=clock.t)
                if hanging:
                    a = act(r, lay, "collective", "all_reduce", "world", step=step, host=f"n{node}", time=clock.t)
                    if r == hung:
                        # in its backward since the stall began (one entered a moment ago is still moving)
                        a = act(r, lay, "backward", step=step, host=f"n{node}", since=clock.t - 10.5, time=clock.t)
                rows.append(list(astuple(a)))
            yield {
                "version": 1,
                "node": f"n{node}",
                "run_id": "r",
                "time": clock.t,
                "layout": [8, 16, 128],
                "rows": rows,
            }

    for step in (1, 2):
        clock.t += 1
        for body in digests(step, False):
            _, rows, _ = view.ingest(msgspec.convert(body, NodeDigest))
            for a in rows:
                monitor.observe(a, view.layout, clock.t)
    clock.t += 11
    for body in digests(2, True):
        for a in view.ingest(msgspec.convert(body, NodeDigest))[1]:
            monitor.observe(a, view.layout, clock.t)
    [record] = monitor.check(view.rows())
    culprit = record["evidence"]["culprit"]
    assert culprit["rank"] == hung and culprit["kind"] == "backward" and culprit["host"] == f"n{hung // per_node}"
    assert record["evidence"]["waiting_count"] == lay.world - 1
    assert (culprit["stage"], culprit["tp_rank"], culprit["dp_rank"]) == ((hung // 8) % 16, hung % 8, hung // 128)


def test_when_several_ranks_are_gone_the_one_the_others_waited_for_is_named():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=1, step=3, state="gone", time=9.0),
        1: act(1, lay, "backward", step=3, state="gone", time=5.0),
    }
    rows[0], rows[1] = replace(rows[0], time=1.0), replace(rows[1], time=2.0)  # sampling order says nothing
    [record] = monitor.check(rows)
    assert record["rule"] == "rank-gone" and record["evidence"]["culprit"]["rank"] == 1
    assert record["evidence"]["gone"] == [1, 0]


def test_the_ranks_last_waits_never_name_an_echo_over_a_rank_gone_without_a_word():
    """Found by the cross-node kill test: rank 1 was killed while it waited on rank 0, and rank 0 then
    crashed of the lost peer. The waits point at rank 0, but its error says it is an echo: rank 1 is named."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    rows = {
        0: replace(act(0, lay, "backward", step=3, state="crashed"), error=PEER_LOST),
        1: act(1, lay, "recv", "recv", "pp", peer=0, step=3, state="gone"),
    }
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1 and record["evidence"]["gone"] == [1, 0]


def test_a_picture_older_than_the_stall_is_not_judged_until_twice_the_bound():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 6):
        clock.t += 1.0
        monitor.observe(act(0, lay, "forward", step=step, time=clock.t), lay, clock.t)
    # rank 0's latest sample predates the last boundary: a late digest
    rows = {0: act(0, lay, "forward", step=4, time=clock.t - 3), 1: act(1, lay, "backward", step=5, time=clock.t + 1)}
    clock.t += 11
    assert monitor.check(rows) == []
    clock.t += 10
    [record] = monitor.check(rows)
    assert record["evidence"]["stale_ranks"] == 1


def test_between_equal_sinks_the_one_reporting_after_the_stall_is_named():
    lay = RankLayout(1, 1, 3)
    rows = {
        0: act(0, lay, "forward", since=10.0, time=50.0),  # a late report from before the stall
        1: act(1, lay, "backward", since=60.0, time=95.0),
        2: act(2, lay, "boundary", "all_reduce", "world", time=95.0),
    }
    assert find_culprit(rows, lay)["culprit"] == 0  # without timing, the oldest span wins the tie
    assert find_culprit(rows, lay, fresh_after=90.0)["culprit"] == 1


# --------------------------------------------------------------------------- when the stall began


def test_stall_starts_at_the_ranks_step_boundary_not_at_the_reports_arrival():
    p = Progress(HangSettings())
    # Step 7 ended at 100.0 on the rank; sampled at 100.8; the digest reached the leader at 101.5.
    p.observe(7, 0.5, now=101.5, sampled=100.8, step_end=100.0)
    assert p.time == pytest.approx(100.0) and p.sampled == 100.8
    assert p.stalled_for(110.0) == pytest.approx(10.0)  # not 8.5 (timed from the arrival)


@pytest.mark.parametrize("skew", [-30.0, -5.0, -1.0, 0.0, 1.0, 5.0, 30.0, 3600.0])
def test_a_skewed_rank_clock_moves_the_stall_start_by_at_most_the_report_latency(skew):
    """The boundary truly ended at 100.0 (leader's clock); the rank's clock reads `skew` more; its
    sample was taken 0.8 s later and reached the leader 0.3 s after that."""
    true_end, age, transit = 100.0, 0.8, 0.3
    arrival = true_end + age + transit
    start = Progress.boundary_time(arrival, sampled=true_end + age + skew, step_end=true_end + skew)
    assert start <= arrival - age  # never after the sample was taken: a clock ahead cannot delay the hang...
    assert start >= true_end - MAX_REPORT_LATENCY_SECONDS  # ...and one behind starts it at most this early
    if abs(skew) <= transit:
        assert start == pytest.approx(true_end + skew)  # within the window the rank's clock is believed
    if skew > 0:
        assert start - true_end <= transit + 1e-9  # late by at most the transit
    if skew < 0:
        assert true_end - start <= MAX_REPORT_LATENCY_SECONDS - transit + 1e-9


def test_stall_start_without_step_end_or_time():
    assert Progress.boundary_time(50.0, sampled=None, step_end=None) == 50.0  # nothing known: the arrival
    assert Progress.boundary_time(50.0, sampled=49.5, step_end=None) == 49.5  # an older collector: its sample
    assert Progress.boundary_time(50.0, sampled=1e10, step_end=None) == 50.0  # a clock far ahead: clamped
    assert Progress.boundary_time(50.0, sampled=0.0, step_end=None) == 50.0 - MAX_REPORT_LATENCY_SECONDS
    p = Progress(HangSettings())
    p.observe(3, 0.1, now=50.0, sampled="garbage", step_end=float("nan"))  # unvalidated digest fields
    assert p.time == 50.0


def test_stall_start_never_goes_back_to_an_earlier_step():
    p = Progress(HangSettings())
    p.observe(1, 0.1, now=10.0, sampled=10.0, step_end=10.0)
    p.observe(2, 0.1, now=11.0, sampled=11.0, step_end=5.0)  # a clock stepped back between steps
    assert p.time == 10.0 and p.step == 2


def _stalled_monitor(step_end_skew):
    """Steps 1..5 of 1 s each, reported by a rank whose clock reads `step_end_skew` more than the
    leader's, 0.5 s after its boundary (sample) + 0.5 s transit; then rank 1 hangs in its forward."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 6):
        clock.t += 1.0
        end = clock.t - 1.0  # the boundary ended 1 s before the report arrived
        monitor.observe(
            replace(act(0, lay, "forward", step=step, time=end + 0.5 + step_end_skew), step_end=end + step_end_skew),
            lay,
            clock.t,
        )
    boundary = clock.t - 1.0
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=1, step=5, time=clock.t + step_end_skew),
        1: act(1, lay, "forward", step=5, since=boundary + 0.01, time=clock.t + step_end_skew),
    }
    return monitor, clock, engine, rows, boundary


def test_hang_is_decided_at_the_bound_after_the_boundary_never_before():
    """Issue 44: a stall shorter than the bound is never named (until 2026-12-05 the line was one ask,
    0.25 s, before the bound, and a stall ending 0.1 s short of it was named a hang)."""
    monitor, clock, engine, rows, boundary = _stalled_monitor(0.0)
    assert monitor.every == JUDGE_EVERY_SECONDS == 0.25
    clock.t = boundary + 4.0
    assert monitor.seconds_until_due() == pytest.approx(10.0 - 4.0)  # the leader's loop wakes then
    for short in (0.25, 0.1, 0.001):
        clock.t = boundary + 10.0 - short
        assert not monitor.due(gone_hint=False) and monitor.check(rows) == []
    clock.t = boundary + 10.0
    assert monitor.due(gone_hint=False) and monitor.seconds_until_due() is None  # asked at the line
    [record] = monitor.check(rows)
    assert monitor.seconds_until_due() is None  # recorded: nothing more to wake for
    assert record["evidence"]["culprit"]["rank"] == 1
    assert record["evidence"]["stalled_since"] == pytest.approx(boundary)
    assert record["evidence"]["stalled_seconds"] == pytest.approx(10.0)
    assert record["evidence"]["bound_seconds"] == 10.0


@pytest.mark.parametrize("skew", [-60.0, 0.0, 60.0])
def test_a_slow_step_whose_culprit_is_still_moving_through_its_spans_is_no_hang(skew):
    """Found by test_hang_e2e's crash test at a 2 s bound and 1.28 s steps: a step 1.4x the median passed
    the decision line while the rank the others waited for had entered its forward 0.8 s before; it was
    named a hang. The stall now counts from that rank's current span when it began later (its age on the
    rank's clock plus the time since its sample arrived: a rank clock a minute off changes nothing)."""
    monitor, clock, engine, rows, boundary = _stalled_monitor(skew)
    line = monitor.decision_line()
    clock.t = boundary + line + 1.0  # past the line since the boundary ...
    entered = clock.t - 0.8  # ... but rank 1 entered its forward 0.8 s ago

    def judge_at(t: float) -> list[dict]:
        """Rank 1 reports, as once a second, still in that forward (sampled 0.3 s before the leader judges)."""
        clock.t = t
        rows[1] = replace(rows[1], since=entered + skew, time=t - 0.3 + skew)
        monitor.observe(rows[1], monitor.layout, t - 0.3)
        return monitor.check(rows)

    assert judge_at(clock.t) == [] and engine.records == []
    assert monitor.seconds_until_due() == pytest.approx(entered + line - clock.t)  # the leader asks right then
    assert judge_at(entered + line - 0.01) == []
    [record] = judge_at(entered + line)  # in the same span for the decision line: hung
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1


@pytest.mark.parametrize("skew", [-60.0, 60.0])
def test_a_rank_clock_a_minute_off_neither_fakes_nor_delays_a_hang_past_the_report_latency(skew):
    monitor, clock, engine, rows, boundary = _stalled_monitor(skew)
    start = monitor.progress.time
    assert boundary - MAX_REPORT_LATENCY_SECONDS <= start <= boundary + 0.5 + 1e-9
    clock.t = start + 10.0 - 0.01
    assert monitor.check(rows) == []
    clock.t = start + 10.0
    [record] = monitor.check(rows)
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1


def _step(monitor, clock, lay, step, seconds=0.5):
    """Both ranks end `step` now (their clocks read the leader's) and report it."""
    clock.t += seconds
    for r in (0, 1):
        monitor.observe(replace(act(r, lay, "forward", step=step, time=clock.t), step_end=clock.t), lay, clock.t)


def test_a_rollback_replay_longer_than_the_bound_is_progress_not_a_hang():
    """Issue 24, item 1: on 40e8301 the stall clock moved only on a new highest step, so replaying
    steps 25..102 after a rollback from 102 read as a stall, and --hang-abort killed a healthy run."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 103):
        _step(monitor, clock, lay, step)
    bound = monitor.progress.bound()
    for step in range(25, 25 + int(3 * bound / 0.5) + 2):  # replay for over 3x the bound
        _step(monitor, clock, lay, step)
        rows = {r: act(r, lay, "forward", step=step, time=clock.t) for r in (0, 1)}
        assert monitor.check(rows) == [], step
    assert monitor.progress.step == step and monitor.progress.stalled_for(clock.t) == 0.0
    assert engine.records == []


def test_a_rollback_rearms_the_clock_with_the_start_up_bound_until_the_next_boundary():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 11):
        _step(monitor, clock, lay, step)
    normal = monitor.progress.bound()
    clock.t += 5.0
    monitor.progress.rearm(clock.t)  # the leader decided a rollback: the load starts now
    assert monitor.progress.stalled_for(clock.t) == 0.0
    assert monitor.progress.bound() > normal  # a checkpoint load is slow: the start-up bound
    clock.t += normal + 1.0  # past the normal bound, within the start-up one: no hang yet
    rows = {r: act(r, lay, "forward", step=10, time=clock.t) for r in (0, 1)}
    assert monitor.check(rows) == []
    _step(monitor, clock, lay, 4)  # the replay's first boundary (loaded step 3): the normal bound again
    assert monitor.progress.bound() == normal and monitor.progress.step == 4


def test_a_hang_pointing_at_ranks_the_leader_cannot_see_names_no_culprit_and_states_coverage():
    """Issue 24, item 5: on 40e8301, without node 1's digests the leader named rank 2 "(stage None,
    host None)" with confidence. Now it names none, says where the waits point and what it sees."""
    from parwatch.sidecar.hang import coverage

    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 4, 1)
    for step in range(1, 6):
        clock.t += 0.5
        for r in (0, 1):
            monitor.observe(replace(act(r, lay, "forward", step=step, time=clock.t), step_end=clock.t), lay, clock.t)
    clock.t += 30.0
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=1, step=5, time=clock.t),
        1: act(1, lay, "recv", "recv", "pp", peer=2, step=5, time=clock.t),
    }  # rank 2: never reported
    [record] = monitor.check(rows, coverage=coverage(rows, lay.world, []))
    evidence = record["evidence"]
    assert record["rule"] == "hang" and evidence["culprit"] is None
    assert evidence["points_at"] == {"rank": 2, "seen": False}
    assert evidence["coverage"] == {"ranks_seen": 2, "world": 4, "nodes_missing": [], "ranks_never_seen": [2, 3]}
    assert "no current report" in record["reason"] and "sees 2 of 4 ranks" in record["reason"]
    assert monitor.rank_states(rows) == {0: 0, 1: 0}


def test_a_node_whose_digests_stopped_is_missing_and_its_ranks_unknown():
    from parwatch.sidecar.digest import LeaderView

    clock = Clock()
    view = LeaderView(clock, grace_seconds=5.0)
    lay = RankLayout(1, 2, 1)
    rows = [act(r, lay, "forward", step=3, time=clock.t) for r in (0, 1)]
    view.ingest(NodeDigest(1, "pw-node1:9401", "r", clock.t, (1, 2, 1), rows))
    assert {a.state for a in view.rows().values()} == {"running"} and view.missing_nodes() == []
    clock.t += 6.0
    assert {a.state for a in view.rows().values()} == {"unknown"}
    assert view.missing_nodes() == [NodeMissing(node="pw-node1:9401", since=1000.0)]


def test_a_digest_row_ahead_of_the_run_is_held_alone_and_its_ranks_last_row_kept():
    """Refused whole, one row ahead of the run (a rank's forged report a node took) blinded the leader to
    every rank of that node, every second the row stayed its rank's latest: the node then read missing."""
    clock = Clock()
    view = LeaderView(clock, grace_seconds=5.0)
    lay = RankLayout(1, 4, 1)
    send = lambda rows: view.ingest(NodeDigest(1, "b:9401", "r", clock.t, (1, 4, 1), rows))  # noqa: E731
    send([act(r, lay, "forward", step=12, time=clock.t) for r in (1, 2, 3)])
    clock.t += 1.0
    _, rows, held = send([act(1, lay, step=10**9, time=clock.t), *(act(r, lay, step=13, time=clock.t) for r in (2, 3))])
    assert list(held) == [0] and held[0].startswith("digest.rows[0].step=1000000000 is ahead of the run")
    assert {a.rank: a.step for a in rows} == {1: 12, 2: 13, 3: 13}  # rank 1: its last row, not the claim
    assert {r: a.step for r, a in view.rows().items()} == {1: 12, 2: 13, 3: 13} and view.pace.high == 13
    _, rows, held = send([act(r, lay, step=14, time=clock.t) for r in (1, 2, 3)])
    assert held == {} and {a.step for a in rows} == {14}
    # A rank the node never sent before is left out (a claim other than rank 1's: two ranks that agree are taken).
    view2 = LeaderView(clock, grace_seconds=5.0, pace=view.pace)
    _, rows, held = view2.ingest(
        NodeDigest(
            1,
            "c:9401",
            "r",
            clock.t,
            (1, 4, 1),
            [act(0, lay, step=10**8, time=clock.t)] + [act(1, lay, step=14, time=clock.t)],
        )
    )
    assert list(held) == [0] and [a.rank for a in rows] == [1]
    with pytest.raises(BadActivity, match=r"digest.rows\[0\].step=1000000000 is ahead"):  # nothing else: refused
        send([act(1, lay, step=10**9, time=clock.t)])


def test_the_leader_hears_every_node_since_a_time_unless_one_is_quiet():
    from parwatch.sidecar.digest import LeaderView

    clock = Clock()
    view = LeaderView(clock, grace_seconds=5.0)
    lay = RankLayout(1, 2, 1)
    view.ingest(NodeDigest(1, "a:9401", "r", clock.t, (1, 2, 1), [act(0, lay, step=3, time=clock.t)]))
    clock.t += 1.0
    view.ingest(NodeDigest(1, "b:9401", "r", clock.t, (1, 2, 1), [act(1, lay, step=3, time=clock.t)]))
    assert view.heard_since(1000.0) and not view.heard_since(1000.5)  # node a: nothing since 1000.0
    clock.t += 5.0  # node a is missing now: it no longer holds the answer back (its ranks read unknown)
    assert view.heard_since(1000.5) and not view.heard_since(1001.5)


def test_a_second_run_starts_its_stall_clock_afresh():
    """Found in CI: a second run on the same leader inherited the first run's stall clock (its last
    step 11), so the second run's start-up read as a 10 s stall and a hang was named."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    for step in range(1, 12):
        _step(monitor, clock, lay, step)
    monitor.begin_run()
    clock.t += 15.0  # the next run's start-up: imports, rendezvous, process groups
    rows = {r: act(r, lay, "forward", step=-1, time=clock.t) for r in (0, 1)}
    for r in (0, 1):
        monitor.observe(rows[r], lay, clock.t)
    assert monitor.check(rows) == [] and monitor.progress.step == -1


PEER_LOST = "RuntimeError: [/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"


def test_ranks_that_only_lost_a_peer_point_at_the_ranks_the_leader_cannot_see():
    """A node lost whole: its ranks read `unknown` at the leader, the others crashed of a lost peer. The
    failure is among the unseen ranks: rank-gone points there and names no culprit (issue 24 item 4)."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(2, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    rows = {r: replace(act(r, lay, "forward", step=6, state="crashed"), error=PEER_LOST) for r in (0, 1)}
    rows.update({r: act(r, lay, "forward", step=6, state="unknown") for r in (2, 3)})
    coverage = Coverage(ranks_seen=2, world=4, nodes_missing=[NodeMissing(node="n1", since=990.0)], ranks_never_seen=[])
    [record] = monitor.check(rows, coverage=coverage)
    evidence = record["evidence"]
    assert record["rule"] == "rank-gone" and evidence["culprit"] is None
    assert evidence["points_at"] == {"rank": 2, "seen": False} and evidence["gone"] == [0, 1]
    assert "no current report of ranks [2, 3]" in record["reason"]


def test_echoes_wait_for_ranks_never_reported_before_pointing_at_them():
    """Found in CI (8ffa4a6): rank 3 raised in the run's first second, before its node had forwarded any
    report; rank 1's echo reached the leader first and rank-gone named no culprit ("never reported: ranks
    [2, 3]"). Ranks never heard of may be on their way: the echo waits FIRST_FORWARD_SECONDS for them."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(2, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    echo = {r: replace(act(r, lay, "forward", step=6, state="crashed"), error=PEER_LOST) for r in (0, 1)}
    unseen = Coverage(ranks_seen=2, world=4, nodes_missing=[], ranks_never_seen=[2, 3])
    assert monitor.check(echo, coverage=unseen) == []
    clock.t += FIRST_FORWARD_SECONDS / 2  # node 1's first forward: rank 3 crashed of its own error
    told = {**echo, 2: act(2, lay, "forward", step=6), 3: act(3, lay, "forward", step=6, state="crashed")}
    told[3] = replace(told[3], error="InjectedError: boom")
    [record] = monitor.check(told, coverage=Coverage(ranks_seen=4, world=4, nodes_missing=[], ranks_never_seen=[]))
    assert record["evidence"]["culprit"]["rank"] == 3 and "InjectedError" in record["reason"]
    monitor2, clock2, _ = _monitor()  # they never come: the failure is put among them, as before
    monitor2.observe(act(0, lay, step=6), lay, clock2.t)
    assert monitor2.check(echo, coverage=unseen) == []
    clock2.t += FIRST_FORWARD_SECONDS
    [record] = monitor2.check(echo, coverage=unseen)
    assert record["evidence"]["culprit"] is None and record["evidence"]["unseen"] == [2, 3]


def test_echoes_alone_wait_for_the_first_failure_before_one_is_named():
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    echo = {
        0: replace(act(0, lay, "recv", "recv", "pp", peer=1, step=6, state="crashed"), error=PEER_LOST),
        1: act(1, lay, "forward", step=6),
    }
    assert monitor.check(echo) == []  # the rank that failed first may yet say so
    clock.t += 3
    told = {**echo, 1: replace(act(1, lay, "forward", step=6, state="crashed"), error="InjectedError: boom")}
    [record] = monitor.check(told)
    assert record["evidence"]["culprit"]["rank"] == 1  # the cause, not the echo
    monitor2, clock2, _ = _monitor()
    monitor2.observe(act(0, lay, step=6), lay, clock2.t)
    assert monitor2.check(echo) == []
    clock2.t += 9  # past ECHO_WAIT_SECONDS with nothing more: the echo is named, as before
    [record] = monitor2.check(echo)
    assert record["evidence"]["culprit"]["rank"] == 0


def test_a_rank_gone_silently_beside_an_echo_waits_for_every_node_to_speak():
    """Found in CI: node 1 SIGKILLed whole; on node 0, rank 1 crashed of the lost peer and torchrun then
    ended rank 0 (gone, no error). Rank 0 was named before node 1 counted as missing. Now the leader waits
    while a node has sent nothing since the echo, and points at that node's ranks once it is missing."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(2, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    rows = {
        0: act(0, lay, "forward", step=6, state="gone"),
        1: replace(act(1, lay, "recv", "recv", "pp", peer=3, step=6, state="crashed"), error=PEER_LOST),
        2: act(2, lay, "forward", step=6),
        3: act(3, lay, "forward", step=6),
    }
    echo_at = clock.t
    node1_heard_at = echo_at - 0.5  # node 1's last digest came before the echo

    def heard_since(t):
        return node1_heard_at >= t

    assert monitor.check(rows, heard_since=heard_since) == []
    clock.t += 5.5  # node 1 is missing now: its ranks read unknown
    rows.update({r: replace(rows[r], state="unknown") for r in (2, 3)})
    [record] = monitor.check(rows, heard_since=heard_since)
    evidence = record["evidence"]
    assert record["rule"] == "rank-gone" and evidence["culprit"] is None
    assert evidence["points_at"] == {"rank": 2, "seen": False} and sorted(evidence["gone"]) == [0, 1]


def test_a_rank_gone_silently_beside_an_echo_is_named_once_every_node_spoke():
    """A rank killed (gone, no error) and its peer's echo, every node heard since: the killed rank is
    named at once, not after ECHO_WAIT_SECONDS."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    rows = {
        0: replace(act(0, lay, "recv", "recv", "pp", peer=1, step=6, state="crashed"), error=PEER_LOST),
        1: act(1, lay, "forward", step=6, state="gone"),
    }
    heard = {"at": clock.t - 0.5}
    assert monitor.check(rows, heard_since=lambda t: heard["at"] >= t) == []
    clock.t += 0.6
    heard["at"] = clock.t  # the other node's next digest
    [record] = monitor.check(rows, heard_since=lambda t: heard["at"] >= t)
    assert record["evidence"]["culprit"]["rank"] == 1 and record["evidence"]["culprit"]["state"] == "gone"
    alone, clock2, _ = _monitor()  # one sidecar: nobody else to hear from
    alone.observe(act(0, lay, step=6), lay, clock2.t)
    [record] = alone.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1


def test_the_rank_its_node_saw_end_first_is_named_over_stale_waits():
    """Found in a cross-node kill test: rank 3 exited hard, and torchrun ended its TP peer rank 2 47 ms
    later, without a word either. Their last samples were up to a second old: rank 3's showed it waiting
    in a TP all-reduce for rank 2, which read as rank 2 being the one the others waited for. The exits
    their node saw (pidfd stamps) say rank 3 ended first: it is named, rank 2 is also gone."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(2, 2, 1)
    monitor.observe(act(0, lay, step=6), lay, clock.t)
    waits = {
        0: replace(act(0, lay, "recv", "recv", "pp", peer=2, step=6, state="crashed"), error=PEER_LOST),
        1: replace(act(1, lay, "recv", "recv", "pp", peer=3, step=6, state="crashed"), error=PEER_LOST),
        2: act(2, lay, "forward", step=6, state="gone", time=50.0),
        3: act(3, lay, "collective", "all_reduce", "tp", seq=34, step=6, state="gone", time=50.4),
    }
    guessed, _, _ = _monitor()
    guessed.observe(act(0, lay, step=6), lay, clock.t)
    [record] = guessed.check(waits)  # no exits seen: the stale waits name rank 2
    assert record["evidence"]["culprit"]["rank"] == 2
    seen = {**waits, 2: replace(waits[2], ended=51.047), 3: replace(waits[3], ended=51.0)}
    [record] = monitor.check(seen)
    assert record["evidence"]["culprit"]["rank"] == 3 and record["evidence"]["gone"] == [3, 2, 0, 1]


def test_exits_on_different_hosts_do_not_overrule_the_waits():
    """Two hosts' clocks are not one clock: exits seen on different nodes are not compared."""
    monitor, clock, engine = _monitor()
    lay = RankLayout(1, 2, 1)
    monitor.observe(act(0, lay, step=3), lay, clock.t)
    rows = {
        0: act(0, lay, "recv", "recv", "pp", peer=1, step=3, state="gone", host="h0"),
        1: act(1, lay, "backward", step=3, state="gone", host="h1"),
    }
    rows = {0: replace(rows[0], ended=10.0), 1: replace(rows[1], ended=10.5)}
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1  # rank 0 waited for it


def test_a_restarted_process_starts_up_under_the_start_up_bound_not_the_steps():
    """CI on 4d1d37f: a rank restarted with --resume under the same run id after a crash was taken for a
    hang (no boundary for the crash, the gap and its start-up > 3 s) before its checkpoint load said busy."""
    monitor, clock, engine = _monitor(HangSettings())
    lay = RankLayout(1, 2, 1)
    for step in range(1, 9):
        _step(monitor, clock, lay, step, seconds=0.1)
    gone = {r: act(r, lay, "forward", step=8, state="gone", time=clock.t) for r in (0, 1)}  # as its node saw
    assert [r["rule"] for r in monitor.check(gone)] == ["rank-gone"]
    clock.t += 6.0  # the gap, then the new processes' imports and rendezvous: no report says busy
    restarted = {r: replace(act(r, lay, step=6, time=clock.t), pid=5000 + r) for r in (0, 1)}
    for a in restarted.values():
        monitor.observe(a, lay, clock.t)
    for _ in range(20):  # 10 s of start-up, judged against the start-up bound (60 s)
        clock.t += 0.5
        assert monitor.check(restarted) == []
    _step(monitor, clock, lay, 7, seconds=0.1)  # its first boundary: the step bound again
    assert monitor.progress.bound() == HangSettings.min_seconds and not monitor.hang_detected
    clock.t += 3.5
    assert [r["rule"] for r in monitor.check({r: act(r, lay, step=7, time=clock.t) for r in (0, 1)})] == ["hang"]


def test_new_pids_alone_do_not_hold_the_stall_clock_back():
    """A rank's reports under ever new pids, its process never seen ending, are no restart: the hang is
    named at the bound (a credential holder cannot blind the detector by changing the pid it reports)."""
    monitor, clock, engine = _monitor(HangSettings())
    lay = RankLayout(1, 2, 1)
    for step in range(1, 9):
        _step(monitor, clock, lay, step, seconds=0.1)
    for k in range(15):  # 3.75 s of reports, each under another pid
        clock.t += 0.25
        for r in (0, 1):
            monitor.observe(replace(act(r, lay, step=8, time=clock.t), pid=7000 + 10 * k + r), lay, clock.t)
    rows = {r: replace(act(r, lay, step=8, time=clock.t), pid=7140 + r) for r in (0, 1)}
    assert [r["rule"] for r in monitor.check(rows)] == ["hang"]


def test_a_survey_taken_in_slices_is_the_survey_taken_whole(monkeypatch):
    """The leader takes its passes over every rank in slices between posts (Survey.slices): each slice a
    part, the picture the same as one pass: what it sees, the ended ranks, the stale count, the culprit."""
    import parwatch.sidecar.hang as hang

    monkeypatch.setattr(hang, "SURVEY_SLICE", 3)
    monitor, clock, _ = _monitor()
    lay = RankLayout(8, 1, 1)  # rank 5 computes; the rest of its TP group waits in the all-reduce; rank 7 ended
    for step in range(1, 6):
        clock.t += 1.0
        for r in range(8):
            monitor.observe(act(r, lay, "forward", step=step, time=clock.t), lay, clock.t)
    rows = {r: act(r, lay, "collective", "all_reduce", "tp", seq=9, step=5, time=1002.5 + r) for r in range(8)}
    rows[6] = act(6, lay, "collective", "all_reduce", "tp", seq=9, step=5, time=clock.t)  # its newest sample
    rows[5] = act(5, lay, "forward", step=5, since=1004.0)
    rows[7] = act(7, lay, "collective", "all_reduce", "tp", seq=9, step=5, state="crashed")
    whole = monitor.survey(rows).whole()
    sliced = monitor.survey(rows)
    assert sum(1 for _ in sliced.slices()) == 3  # 8 ranks, 3 at a time
    taken = lambda s: (s.seen, s.stale, s.ended, s.oldest_heard)  # noqa: E731
    assert taken(sliced) == taken(whole) == (8, 2, {7: 1007}, clock.t)  # ranks 0 and 1 sampled before step 5
    assert sliced.waits.culprit(lay) == whole.waits.culprit(lay) == find_culprit(rows, lay)
    assert find_culprit(rows, lay)["culprit"] == 5


def test_state_counts_count_what_rank_states_tell():
    """GET /v1/hang counts the ranks by state (at 16,384 ranks without a value per rank): the same states
    as parwatch_rank_state's, the named culprit hung, done ranks left out."""
    monitor, clock, _ = _monitor()
    rows = _rank_1_stalls(monitor, clock)
    clock.t += 10.5
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1
    lay = RankLayout(1, 2, 1)
    states = ["running", "crashed", "gone", "unknown", "silent", "done", "running"]
    rows = {**rows, **{r: replace(act(r % 2, lay, "forward"), rank=r, state=s) for r, s in enumerate(states, 2)}}
    told = {}
    for value in monitor.rank_states(rows).values():
        told[value] = told.get(value, 0) + 1
    counts = monitor.state_counts(rows)
    assert {RANK_STATES[s]: n for s, n in counts.items()} == told
    assert counts == {"running": 3, "hung": 2, "gone": 2, "unknown": 1}  # the culprit and the silent rank hung
