"""Issue 44's hang judgement over activity pictures: what kind of hang a culprit is in (host, peer,
transport, device), a receive answered by a posted send, a rank busy in a declared long activity held
to its own bound, a late node held back, a node lost told as its ranks gone, a lost sidecar told apart
from lost ranks, and the evidence bundle every hang or crash decision names."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from parwatch.rank_layout import RankLayout as Layout
from parwatch.sidecar.digest import LeaderView
from parwatch.sidecar.hang import HangMonitor, HangSettings, coverage, find_culprit
from parwatch.vocabulary import SpanKind
from parwatch.wire.activity import NodeDigest
from parwatch.wire.findings import Missing
from tests.unit.test_hang_analysis import Clock, FakeEngine, act

PP2 = Layout(1, 2, 1)
TP2 = Layout(2, 1, 1)


def test_a_receive_whose_send_is_posted_waits_for_nobody_and_is_a_transport_stall():
    """Rank 1 is in its receive #7 from rank 0, which posted 7 sends to it, and rank 0 waits in a receive
    from rank 1 (the cycle 1F1B makes): rank 1 is the culprit, its bytes do not move."""
    rows = {
        0: replace(act(0, PP2, "recv", "recv", "pp", peer=1, seq=5, since=101.0), sent=[(1, 7)]),
        1: act(1, PP2, "recv", "recv", "pp", peer=0, seq=7, since=100.5),
    }
    found = find_culprit(rows, PP2)
    assert (found["culprit"], found["kind"], found["kind_waits_on"]) == (1, "transport", [0]), found
    assert found["waiting"] == [0] and found["waits_on"] == {0: [1]}
    # Without the posted send the same picture is a cycle of receives, each waiting on a peer.
    rows[0] = replace(rows[0], sent=[(1, 6)])
    assert find_culprit(rows, PP2)["kind"] == "peer"


def test_a_send_whose_peer_is_in_the_matching_receive_is_a_transport_stall_named_at_the_sender():
    """A blocking send stuck (numbered, so counted as posted) and its receiver: both ends entered; the
    sender is named (the bytes do not leave it), not the receiver its count would answer."""
    rows = {
        0: replace(act(0, PP2, "send", "send", "pp", peer=1, seq=3), sent=[(1, 3)]),
        1: act(1, PP2, "recv", "recv", "pp", peer=0, seq=3),
    }
    found = find_culprit(rows, PP2)
    assert (found["culprit"], found["kind"], found["waits_on"]) == (0, "transport", {1: [0]})


def test_a_rank_in_its_own_work_is_host_blocked_and_its_waiters_are_listed():
    rows = {
        0: act(0, TP2, "collective", "all_reduce", "tp", seq=9),
        1: act(1, TP2, "forward"),
    }
    found = find_culprit(rows, TP2)
    assert (found["culprit"], found["kind"], found["waits_on"]) == (1, "host", {0: [1]})
    assert found["missing"] == Missing(kind=SpanKind.COLLECTIVE, op="all_reduce", group="tp", seq=9)


def test_a_collective_every_member_entered_is_a_transport_stall():
    rows = {r: act(r, TP2, "collective", "all_reduce", "tp", seq=9, since=100.0 + r) for r in (0, 1)}
    assert find_culprit(rows, TP2)["kind"] == "transport"


def test_a_device_stuck_on_one_compute_span_is_the_devices():
    stuck = dict(device_since=99.0, device_kind="forward", sent=[(0, 2)])
    rows = {
        0: act(0, PP2, "recv", "recv", "pp", peer=1, seq=2),
        1: replace(act(1, PP2, "boundary", "all_reduce", "world"), **stuck),
    }
    # Rank 1's host enqueued its send and waits in the boundary; its device is still in the forward before
    # that send: rank 0's receive is not answered, and rank 1 waits for nobody.
    found = find_culprit(rows, PP2)
    assert (found["culprit"], found["kind"]) == (1, "device"), found
    rows[1] = replace(rows[1], device_kind="collective")  # an NCCL kernel that never ends: the transport's
    assert find_culprit(rows, PP2)["kind"] == "transport"


def _stepping(monitor, clock, lay, steps=5, step_s=0.2):
    for step in range(1, steps + 1):
        clock.t += step_s
        for r in range(lay.world):
            monitor.observe(replace(act(r, lay, "forward", step=step, time=clock.t), step_end=clock.t), lay, clock.t)


def test_the_default_bound_names_a_hang_at_its_floor_under_short_steps():
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t

    def rows():  # what the ranks report now (once a second, both alive)
        return {0: act(0, PP2, "recv", "recv", "pp", peer=1, step=5, time=clock.t), 1: act(1, PP2, "backward", step=5)}

    floor = HangSettings.min_seconds
    clock.t = boundary + floor - 0.01
    assert monitor.check(rows()) == []
    clock.t += 0.02
    [record] = monitor.check(rows())
    evidence = record["evidence"]
    assert (record["rule"], evidence["bound_seconds"], evidence["kind"]) == ("hang", floor, "host")
    assert record["reason"].startswith("hang (host blocked): ") and evidence["bundle"].startswith("evidence/")


def test_a_transport_stall_is_timed_from_when_its_last_party_entered():
    """The quick campaign's healthy two-node run (CI load, a CPU hog): a rank stopped 1.5 s (a host hiccup)
    entered the TP all-reduce its peer had waited in; 2.8 s after the boundary both were in it, and the
    leader named a transport stall though the bytes could flow only since that entry. It is held until the
    last member has been in it for the decision line; a real transport stall is still named then."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, TP2)
    boundary = clock.t
    entered = {0: boundary + 0.1, 1: boundary + 2.5}  # rank 1 came back from its stop and caught up

    def judge_at(t: float) -> list[dict]:
        clock.t = t
        rows = {r: act(r, TP2, "collective", "all_reduce", "tp", seq=9, since=entered[r], time=t - 0.1) for r in (0, 1)}
        for a in rows.values():
            monitor.observe(a, TP2, t - 0.1)
        return monitor.check(rows)

    assert judge_at(boundary + HangSettings.min_seconds + 0.05) == [] and engine.records == []
    assert judge_at(entered[1] + HangSettings.min_seconds - 0.01) == []
    [record] = judge_at(entered[1] + HangSettings.min_seconds)
    assert (record["rule"], record["evidence"]["kind"]) == ("hang", "transport")


def test_a_rank_in_a_checkpoint_or_eval_is_busy_until_its_own_bound():
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t
    for busy in ("checkpoint", "eval"):
        clock.t = boundary + 30.0  # 10 bounds, half the busy bound: a long save, not a hang
        rows = {r: replace(act(r, PP2, busy, step=5, since=boundary), busy=busy, busy_since=boundary) for r in (0, 1)}
        for a in rows.values():  # they keep reporting it
            monitor.observe(replace(a, time=clock.t), PP2, clock.t)
        assert not monitor.due(gone_hint=False)  # busy time is no stall: nothing to judge
        assert monitor.check(rows) == []
    clock.t = boundary + 60.0 - 0.01  # just short of the busy bound (max(60 s, 20 x 0.2 s)): not yet
    monitor.observe(replace(rows[1], time=clock.t), PP2, clock.t)
    assert not monitor.due(gone_hint=False)
    clock.t = boundary + 60.0  # the busy bound: a save this long
    monitor.observe(replace(rows[1], time=clock.t), PP2, clock.t)
    assert monitor.due(gone_hint=False)
    [record] = monitor.check(rows)
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["kind"] == "eval"
    assert record["evidence"]["busy"] == "eval" and "busy in eval past its bound 60 s" in record["reason"]


def test_the_stall_after_a_long_activity_counts_from_its_end():
    """A 2 s eval and a 1 s checkpoint after the boundary, then a hang in the next forward: named a bound after
    the ranks were last seen busy, not a bound after the boundary (which would be during the eval)."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t
    for t in (0.5, 1.5, 2.5):  # reports during the save and the eval
        clock.t = boundary + t
        for r in (0, 1):
            busy = "checkpoint" if t < 1 else "eval"
            monitor.observe(replace(act(r, PP2, busy, step=5, time=clock.t), busy=busy), PP2, clock.t)
    rows = {0: act(0, PP2, "recv", "recv", "pp", peer=1, step=5), 1: act(1, PP2, "forward", step=5)}
    clock.t = boundary + 4.0  # 4 s after the boundary, 1.5 s after the eval was last seen
    assert not monitor.due(gone_hint=False) and monitor.check(rows) == []
    clock.t = boundary + 2.5 + HangSettings.min_seconds - 0.01  # the bound, counted from the end of the eval
    assert monitor.check(rows) == []
    clock.t += 0.01
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1
    assert record["evidence"]["since_boundary_seconds"] == pytest.approx(2.5 + HangSettings.min_seconds)


def test_the_stall_after_a_long_activity_counts_from_when_its_end_was_heard():
    """Seed 46's long-steps healthy run (2026-12-07): a checkpoint save and an eval pass, then rank 3 stopped
    1.5 s (a host hiccup) at the start of the next step; once it ran again it reported "between spans" and was
    named hung. The ranks' last busy reports had been sampled up to a second before the eval ended: counted
    from them, the hiccup crossed the bound. The end is the first report that shows a rank out of it."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t
    for t in (0.5, 1.5, 2.5):  # busy reports during the save and the eval, once a second
        clock.t = boundary + t
        for r in (0, 1):
            monitor.observe(replace(act(r, PP2, "eval", step=5, time=clock.t), busy="eval"), PP2, clock.t)

    def heard_at(t):  # the eval over, rank 0 waits in a recv from rank 1, between spans (since None)
        clock.t = boundary + t
        rows = {
            0: act(0, PP2, "recv", "recv", "pp", peer=1, step=5, time=clock.t),
            1: act(1, PP2, None, step=5, since=None, time=clock.t),
        }
        for a in rows.values():
            monitor.observe(a, PP2, clock.t)
        return monitor.check(rows)

    assert heard_at(3.4) == []  # the first reports out of the eval
    assert heard_at(2.5 + HangSettings.min_seconds + 0.1) == []  # a bound after the last busy report: no hang
    assert heard_at(3.4 + HangSettings.min_seconds - 0.01) == []
    [record] = heard_at(3.4 + HangSettings.min_seconds + 0.01)  # a bound after the end was heard: a stall
    assert record["evidence"]["culprit"]["rank"] == 1


def test_a_rank_stuck_outside_the_long_activity_is_named_at_the_normal_bound():
    """Rank 1 hung in its forward while rank 0 evaluates (its span says so): the culprit is not busy."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t
    rows = {
        0: replace(act(0, PP2, "recv", "recv", "pp", peer=1, step=5), busy="eval", busy_since=boundary),
        1: act(1, PP2, "forward", step=5),
    }
    clock.t = boundary + 3.0
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1


def _two_nodes(clock):
    view = LeaderView(clock, grace_seconds=5.0)
    lay = Layout(1, 2, 1)
    return view, lay


def test_a_late_rank_holds_the_hang_until_it_speaks_or_its_node_goes_missing_then_its_ranks_are_gone():
    """Node 1 (rank 1) stopped whole mid-step: its last report shows rank 1 computing. At the decision line
    that report is late: no hang is named from the frozen picture; once the node is missing the stall is a
    node lost, its ranks gone."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    view, lay = _two_nodes(clock)
    _stepping(monitor, clock, lay)
    boundary = clock.t
    clock.t += 0.5
    last = act(1, lay, "forward", step=5, time=clock.t)
    view.ingest(NodeDigest(1, "node1:9401", "r", clock.t, (1, 2, 1), [last]))
    monitor.observe(last, lay, clock.t)

    def judge():
        rows = view.rows()
        rows[0] = act(0, lay, "recv", "recv", "pp", peer=1, step=5, time=clock.t)  # rank 0 reports on
        return monitor.check(rows, coverage=coverage(rows, lay.world, view.missing_nodes()))

    clock.t = boundary + 3.0  # the decision line
    assert judge() == [] and monitor.awaiting_fresh  # rank 1's report is 2.5 s old (> 2 s): held, not named
    assert monitor.survey(view.rows()).whole().late(clock.t)
    clock.t = boundary + 6.0
    [record] = judge()  # node 1 missing (5 s): its ranks are gone, the run is not hung
    assert record["rule"] == "rank-gone" and record["evidence"]["cause"] == "node-lost"
    assert record["evidence"]["gone"] == [1] and record["evidence"]["culprit"] is None
    assert record["evidence"]["nodes_lost"] == [{"node": "node1:9401", "since": round(boundary + 0.5, 3)}]
    clock.t += 10
    assert judge() == [] and not monitor.hang_detected  # no hang after it, for the same stall


def test_a_rank_that_speaks_again_lets_the_hang_be_named():
    """A rank paused 1.5 s (a hiccup) is late at the line; once it reports again (still stuck) it is named."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    view, lay = _two_nodes(clock)
    _stepping(monitor, clock, lay)
    boundary = clock.t
    stale = act(1, lay, "forward", step=5, time=boundary + 0.1)
    monitor.observe(stale, lay, boundary + 0.1)
    rank0 = act(0, lay, "recv", "recv", "pp", peer=1, step=5, time=boundary + 3.0)
    clock.t = boundary + 3.0
    assert monitor.check({0: rank0, 1: stale}) == [] and monitor.awaiting_fresh
    clock.t = boundary + 3.2
    fresh = act(1, lay, "forward", step=5, time=clock.t)
    monitor.observe(fresh, lay, clock.t)
    [record] = monitor.check({0: rank0, 1: fresh})
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1


def test_a_lost_sidecar_whose_ranks_train_on_is_sidecar_lost_once():
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    view, lay = _two_nodes(clock)
    view.ingest(NodeDigest(1, "node1:9401", "r", clock.t, (1, 2, 1), [act(1, lay, "forward", step=1, time=clock.t)]))
    silent_since = clock.t
    _stepping(monitor, clock, lay, steps=40)  # 8 s of steps: node 1's digests stopped after the first
    [record] = monitor.check_nodes(view.missing_nodes(), view.ranks_of)
    assert record["rule"] == "sidecar-lost" and record["evidence"]["ranks"] == [1]
    assert record["evidence"]["silent_since"] == silent_since and "train on" in record["reason"]
    assert monitor.check_nodes(view.missing_nodes(), view.ranks_of) == []  # once
    assert "bundle" not in record["evidence"]  # no hang, no crash: no stacks asked


def test_a_node_missing_while_the_run_is_stalled_is_not_a_lost_sidecar():
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    view, lay = _two_nodes(clock)
    _stepping(monitor, clock, lay)
    view.ingest(NodeDigest(1, "node1:9401", "r", clock.t, (1, 2, 1), [act(1, lay, "forward", step=5, time=clock.t)]))
    clock.t += 10  # no boundary since its last digest
    assert monitor.check_nodes(view.missing_nodes(), view.ranks_of) == []


def test_a_sample_that_waited_for_its_nodes_digest_is_dated_by_its_node():
    """A rank stopped right after the boundary: its last sample reached the leader 1 s later, in its node's
    digest. Dated by the digest (one host's clock), it is late at the decision line; dated by its arrival,
    it would not be, and the frozen picture would name a hang."""
    clock, engine = Clock(), FakeEngine()
    monitor = HangMonitor(HangSettings(), engine, clock)
    _stepping(monitor, clock, PP2)
    boundary = clock.t
    last = act(1, PP2, "collective", "all_reduce", "tp", step=5, time=boundary + 0.05)
    monitor.observe(last, PP2, boundary + 1.05, age=1.0)  # the digest left the node 1 s after the sample
    clock.t = boundary + 2.75
    assert monitor.survey({1: last}).whole().late(clock.t)
    monitor.observe(replace(last, rank=0), PP2, boundary + 1.05)  # the same, dated by its arrival
    assert not monitor.survey({0: replace(last, rank=0)}).whole().late(clock.t)
