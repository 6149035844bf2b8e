"""Instances that span nodes (parwatch/sidecar/crossnode.py, transfer.py): a node sidecar sets its
halves aside and forwards them, bounded; the leader matches them by (group, seq) and splits them
like local ones; what never completes is dropped after a bounded time and counted."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from test_digest_api import _Bridge  # the node-to-leader HTTP client stand-in
from test_transfer import MS, ar, families, p2p, samples, summary

from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import Listen, SidecarConfig
from parwatch.sidecar.crossnode import Forwarder, from_wire, to_wire
from parwatch.sidecar.service import build_sidecar
from parwatch.sidecar.transfer import TransferTracker
from parwatch.wire.bodies import MAX_FORWARD_HALVES, InstancesForward
from parwatch.wire.codec import parse
from tests.fixtures import synthetic as syn


class Clock:
    def __init__(self):
        self.t = 1_000.0

    def __call__(self):
        return self.t


TP0, TP1 = {"tp": [0, 1]}, {"tp": [2, 3]}  # node 0 holds stage 0 (ranks 0, 1), node 1 stage 1 (ranks 2, 3)


def carry(node: TransferTracker, leader: TransferTracker, limit: int = MAX_FORWARD_HALVES) -> int:
    """One forward, through the wire format and its validation, as the sidecars do it."""
    entries, rows = node.take_outbox(limit)
    body = parse(to_wire(entries, rows, "node1", node.run_id), InstancesForward)
    return leader.merge(*from_wire(body, world=4))


def test_a_cross_node_send_is_matched_at_the_leader_and_split_like_a_local_one():
    clock = Clock()
    node, leader = TransferTracker(clock=clock), TransferTracker(clock=clock)
    node.forwarding = True
    # rank 0 posts its send to rank 2 at once; rank 2 had waited 7 ms; the link takes 3 ms.
    leader.add(summary(0, 1, [ar(1, 4.0), p2p("send", 1, 2, 3.0)], TP0))
    leader.add(summary(1, 1, [ar(1, 2.0)], TP0))
    node.add(summary(2, 1, [ar(1, 2.0), p2p("recv", 1, 0, 10.0)], TP1))
    node.add(summary(3, 1, [ar(1, 2.0)], TP1))
    assert leader.leading and not node.leading
    assert list(node.pending) == [("p", 0, 2, 1)]  # set aside for the leader at the node's next tick
    assert carry(node, leader) == 1
    assert leader.pending == {} and node.outbox == {}
    fams = families(leader)
    transfer = samples(fams["parwatch_collective_transfer_seconds"], "_sum")
    assert transfer[(("group", "pp"), ("op", "send"))] == pytest.approx(3 * MS)
    waits = samples(fams["parwatch_collective_wait_seconds"], "_total")
    assert waits[(("group", "pp"), ("op", "recv"))] == pytest.approx(7 * MS)
    assert samples(fams["parwatch_collective_busbw_bytes_per_second"])[
        (("group", "pp"), ("op", "send"))
    ] == pytest.approx((1 << 16) / (3 * MS))
    assert samples(fams["parwatch_rank_straggler_seconds"], "_total")[(("rank", "2"),)] == pytest.approx(7 * MS)
    assert leader.take_series()["collective_transfer_seconds"]["op=send,group=pp,src=0,dst=2"] == pytest.approx(3 * MS)
    # the TP all-reduce of each node stays on its node: one matched instance each, nothing unmatched
    node_fams = families(node)
    assert samples(node_fams["parwatch_collective_transfer_seconds"], "_count") == {
        (("group", "tp"), ("op", "all_reduce")): 1
    }
    assert samples(node_fams["parwatch_collective_unmatched"], "_total") == {}
    assert samples(fams["parwatch_collective_unmatched"], "_total") == {}


def test_the_leader_waits_for_a_forwarded_half_by_time_not_steps_then_counts_it_remote():
    clock = Clock()
    leader = TransferTracker(horizon_steps=2, remote_seconds=10.0, clock=clock)
    leader.add(summary(0, 1, [p2p("send", 1, 2, 3.0)]))
    for step in range(2, 30):  # fast steps: 28 steps in 5 s, far past the step horizon
        clock.t += 5.0 / 28
        leader.add(summary(0, step, []))
    assert len(leader.pending) == 1  # still waiting: the forward path takes about a second
    clock.t += 6.0
    leader.tick()  # no summary needed: the activity loop ticks once a second (the run may have ended)
    assert leader.pending == {}
    assert samples(families(leader)["parwatch_collective_unmatched"], "_total") == {
        (("group", "pp"), ("op", "send"), ("reason", "remote")): 1
    }


def test_a_tp_peer_that_reports_a_moment_late_is_still_matched_on_its_node():
    node = TransferTracker(clock=Clock())
    node.forwarding = True
    node.add(summary(2, 1, [ar(1, 5.0)], TP1))  # rank 3's first summary has not arrived yet
    node.add(summary(3, 1, [ar(1, 2.0)], TP1))
    entries, _ = node.take_outbox(100)
    assert entries == []  # nothing set aside: both members report here
    assert samples(families(node)["parwatch_collective_transfer_seconds"], "_count") == {
        (("group", "tp"), ("op", "all_reduce")): 1
    }


def test_a_group_spanning_nodes_completes_from_two_forwards_and_rank_rows_reach_attribution():
    clock = Clock()
    node, leader = TransferTracker(clock=clock), TransferTracker(clock=clock)
    node.forwarding = True
    dp = {"dp": [0, 1, 2, 3]}  # one group over both nodes
    leader.add(summary(0, 6, [["all_reduce", "dp", 1, -1, 0, 9000, 100]], dp, compute=0.3))
    leader.add(summary(1, 6, [["all_reduce", "dp", 1, -1, 0, 8000, 100]], dp, compute=0.3))
    node.add(summary(2, 6, [["all_reduce", "dp", 1, -1, 0, 2000, 100]], dp, compute=0.3))
    assert carry(node, leader) == 0 and len(leader.pending) == 1  # rank 3 still missing
    node.add(summary(3, 6, [["all_reduce", "dp", 1, -1, 0, 5000, 100]], dp, compute=0.3))
    assert carry(node, leader) == 1
    waits = samples(families(leader)["parwatch_rank_straggler_seconds"], "_total")
    assert waits == {(("rank", str(r)),): pytest.approx(w * MS) for r, w in {0: 7, 1: 6, 2: 0, 3: 3}.items()}
    # steps past the warm-up carry each node rank's attribution figures to the leader
    assert {r.rank for r in leader.rank_figures()} == set()  # one step is not a window yet
    for step in range(7, 12):
        for rank in (0, 1):
            leader.add(summary(rank, step, [], compute=0.3))
        for rank in (2, 3):
            node.add(summary(rank, step, [], compute=0.6))
        carry(node, leader)
    figures = {r.rank: r for r in leader.rank_figures()}
    assert set(figures) == {0, 1, 2, 3} and figures[2].compute_seconds == pytest.approx(0.6)
    assert [f.key for f in leader.findings()] == ["cause=slow-compute,stage=1,ranks=2+3"]


def test_a_node_ranks_waits_for_a_cpu_reach_the_leaders_attribution_and_an_older_nodes_rows_still_do():
    clock = Clock()
    node, leader = TransferTracker(clock=clock), TransferTracker(clock=clock)
    node.forwarding = True
    waits = {0: 0.02, 1: 0.02, 2: 0.5, 3: None}  # seconds a second; rank 3's node could not read it
    for step in range(6, 12):
        for rank, tracker in ((0, leader), (1, leader), (2, node), (3, node)):
            tracker.add(summary(rank, step, [], compute=0.3), waits[rank])
    entries, rows = node.take_outbox(100)
    body = to_wire(entries, rows, "node1", node.run_id)
    assert [w[0] for w in body["cpu_waits"]] == [2] * 6  # only what was read
    leader.merge(*from_wire(parse(body, InstancesForward), world=4))
    period = summary(0, 6, []).step_seconds
    figures = {r.rank: r.cpu_wait_seconds for r in leader.rank_figures()}
    assert figures == {
        0: pytest.approx(0.02 * period),
        1: pytest.approx(0.02 * period),
        2: pytest.approx(0.5 * period),
        3: None,
    }
    with pytest.raises(RequestValidationError) as refused:  # a rank outside the world: 422, naming the field
        from_wire(parse({**body, "cpu_waits": [[4, 6, 0.1]]}, InstancesForward), world=4)
    assert refused.value.errors()[0]["loc"] == ("body", "cpu_waits", 0, 0)
    # A node older than the field sends the rows alone: taken, their waits unknown.
    older = TransferTracker(clock=clock)
    older.merge(*from_wire(parse({k: v for k, v in body.items() if k != "cpu_waits"}, InstancesForward), world=4))
    assert {r.rank: r.cpu_wait_seconds for r in older.rank_figures()} == {2: None, 3: None}


def test_the_forwarding_side_is_bounded_and_counts_what_it_could_not_send():
    node = TransferTracker(max_outbox=5, clock=Clock())
    node.forwarding = True
    node.add(summary(2, 1, [p2p("recv", seq, 0, 1.0) for seq in range(1, 9)]))  # 8 instances, room for 5
    first, _ = node.take_outbox(limit=2)
    assert [e.key[3] for e in first] == [4, 5]  # the three oldest went to make room
    unmatched = samples(families(node)["parwatch_collective_unmatched"], "_total")
    assert unmatched == {(("group", "pp"), ("op", "send"), ("reason", "unsent")): 3}

    wide = TransferTracker(clock=Clock())
    wide.forwarding = True
    group = {"dp": list(range(2, 1000))}  # a DP group of 998 ranks, only rank 2 here
    wide.add(summary(2, 1, [["all_reduce", "dp", seq, -1, 0, 10, 8] for seq in (1, 2, 3)], group, dp=500))
    assert len(wide.take_outbox(100, max_members=2000)[0]) == 2  # a third would list 2,994 members

    class Down:
        async def post(self, url, content, headers):
            raise ConnectionError("leader restarting")

    assert asyncio.run(Forwarder(node, "http://leader", "node1", {}).post(Down())) == 0
    assert node.outbox == {}  # the rest went in that post and were lost with it
    unmatched = samples(families(node)["parwatch_collective_unmatched"], "_total")
    assert unmatched == {(("group", "pp"), ("op", "send"), ("reason", "unsent")): 6}


# --- over HTTP, two real sidecar objects --------------------------------------------------------


def _sidecar(tmp_path, name, clock, **cfg):
    config = SidecarConfig(
        state_dir=tmp_path / name,
        token="tok",
        control_listen=Listen("127.0.0.1", 9401),
        metrics_listen=Listen("127.0.0.1", 9400),
        **cfg,
    )
    sidecar = build_sidecar(config, clock=clock)
    sidecar.transfer.clock = clock
    return TestClient(create_control_app(sidecar), headers={"Authorization": "Bearer tok"}), sidecar


def _ingest(client, *ranks, step):
    stages = [syn.stage_view(0, 0.5, 0.4), syn.stage_view(1, 0.5, 0.4)]
    body = {
        "version": 1,
        "summaries": [
            syn.summary(r, step, run_id="r1", tp=2, pp=2, time=float(step), global_stages=stages) for r in ranks
        ],
    }
    r = client.post("/v1/ingest", json=body)
    assert r.status_code == 200, r.text


def test_two_sidecars_match_their_cross_node_sends_through_the_leader(tmp_path):
    clock = Clock()
    leader, lsc = _sidecar(tmp_path, "leader", clock)
    node, nsc = _sidecar(tmp_path, "node", clock, leader_url="http://leader")
    nsc.activity._http = _Bridge(leader)
    for step in (1, 2, 3):
        clock.t += 1
        _ingest(leader, 0, 1, step=step)
        _ingest(node, 2, 3, step=step)
        asyncio.run(nsc.activity.tick())
        asyncio.run(lsc.activity.tick())
    assert lsc.activity.is_leader and lsc.transfer.leading and nsc.transfer.forwarding
    counts = samples(families(lsc.transfer)["parwatch_collective_transfer_seconds"], "_count")
    # synthetic: 4 activations a step from each stage-0 rank to its stage-1 peer, 3 steps, 2 TP ranks
    assert counts[(("group", "pp"), ("op", "send"))] == 3 * 4 * 2
    assert samples(families(nsc.transfer)["parwatch_collective_unmatched"], "_total") == {}
    assert samples(families(lsc.transfer)["parwatch_collective_unmatched"], "_total") == {}


def test_the_instances_endpoint_needs_the_token_and_names_bad_fields(tmp_path):
    clock = Clock()
    leader, lsc = _sidecar(tmp_path, "leader", clock)
    _ingest(leader, 0, 1, step=1)
    half = {
        "op": "send",
        "group": "pp",
        "seq": 1,
        "link": True,
        "members": [0, 2],
        "step": 1,
        "got": [[2, "recv", 4000, 64]],
    }
    good = {"version": 1, "node": "n1", "run_id": "r1", "instances": [half], "ranks": []}
    assert leader.post("/v1/instances", json=good, headers={"Authorization": "Bearer nope"}).status_code == 401

    def refused(body, field):
        r = leader.post("/v1/instances", json=body)
        assert r.status_code == 422 and field in r.json()["detail"], r.text

    refused({**good, "instances": [{**half, "members": [0, 2, 3]}]}, "instances.0")  # a link has two ends
    refused({**good, "instances": [{**half, "got": [[1, "recv", 4000, 64]]}]}, "instances.0")  # not a member
    refused(
        {**good, "instances": [{**half, "members": [0, 9], "got": [[9, "recv", 4000, 64]]}]}, "instances.0.members"
    )  # outside the world of 4
    refused({**good, "instances": [half] * (MAX_FORWARD_HALVES + 1)}, "instances")
    refused({**good, "instances": [{**half, "got": [[2, "recv", -1, 64]]}]}, "instances.0.got.0.2")
    refused({**good, "node": ""}, "node")
    r = leader.post("/v1/instances", json={**good, "run_id": "another-run"})
    assert r.json() == {"matched": 0, "ignored": 1}  # not this leader's run: nothing merged
    r = leader.post("/v1/instances", json=good)
    assert r.status_code == 200 and r.json() == {"matched": 1, "ignored": 0}
    assert samples(families(lsc.transfer)["parwatch_collective_wait_seconds"], "_total")[
        (("group", "pp"), ("op", "recv"))
    ] == pytest.approx(3.5 * MS)  # 4 ms recv - the 0.5 ms synthetic send
