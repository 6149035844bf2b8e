"""Evidence at a decision (issue 44, item 3) on the real control app (FastAPI TestClient, real sidecar
object, real ActivityReporter): a hang's decision names its bundle, the replies to the ranks' activity
(and to a node's digest) ask for evidence, each rank sends its stacks, last spans, activity and Flight
Recorder path once, the leader writes them beside the decision, and what does not fit is refused
naming the field. Across real torchrun nodes: tests/integration/test_evidence_multinode.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from parwatch.cli.control import _decision_line, _hang_line
from parwatch.collector.activity import ActivityReporter
from parwatch.collector.context import RunContext
from parwatch.collector.evidence import enable_flight_recorder
from parwatch.contract import HookRegistry, Observer, SpanKind
from parwatch.credentials import node_credential, rank_credential
from parwatch.report.loader import load_run
from parwatch.report.summary import _evidence_lines
from parwatch.sidecar.hang import HangSettings
from tests.unit.test_digest_api import _Bridge, _client, report


def _app(tmp_path, name, **cfg):
    """test_digest_api's control app, at the default hang bound."""
    bound = {"hang_min_seconds": HangSettings.min_seconds, "hang_step_factor": HangSettings.step_factor}
    return _client(tmp_path, name, **bound, **cfg)


def _reporter(client, rank: int, registry: HookRegistry, clock) -> ActivityReporter:
    ctx = RunContext("r1", rank, 2, 1, 2, 1, 0, 0, rank, "1f1b", 4, hostname="elsewhere")
    return ActivityReporter(ctx, registry, "http://testserver", "tok", http=client, time_fn=clock)


def _hang(client, sidecar, clock, rank0_kw=None) -> dict:
    """Steps 1..3 on both ranks, then rank 1 stays in its forward and rank 0 waits in a receive from it."""
    for step in (1, 2, 3):
        clock.t += 0.2
        for rank in (0, 1):
            client.post("/v1/activity", json=report(rank, step=step, time=clock.t, step_end=clock.t))
    boundary = clock.t
    for _ in range(3):  # both keep reporting, once a second: rank 1 stays in its forward, rank 0 waits for it
        clock.t += 1.0
        rank0 = report(0, kind="recv", peer=1, op="recv", group="pp", time=clock.t, **(rank0_kw or {}))
        client.post("/v1/activity", json=rank0)
        client.post("/v1/activity", json=report(1, kind="forward", time=clock.t, step_end=boundary))
    [record] = asyncio.run(sidecar.activity.judge())
    return record


def test_a_hang_decision_names_its_bundle_and_every_rank_sends_its_evidence_there(tmp_path):
    client, sidecar, clock = _app(tmp_path, "leader")
    record = _hang(client, sidecar, clock)
    bundle = record["evidence"]["bundle"]
    assert bundle == f"evidence/r1/decision-{record['id']}"
    logged = [json.loads(line) for line in (tmp_path / "leader" / "decisions.jsonl").read_text().splitlines()]
    assert logged[-1]["evidence"]["bundle"] == bundle  # linked from decisions.jsonl

    # Rank 1, a real reporter, blocked in its forward on another thread: its next activity post is asked.
    registry = HookRegistry()
    registry.register(Observer())
    rank1 = _reporter(client, 1, registry, clock)
    entered, release = threading.Event(), threading.Event()

    def stuck_in_forward():
        with registry.span(SpanKind.FORWARD, stage=1, microbatch=2):
            entered.set()
            release.wait(30)

    worker = threading.Thread(target=stuck_in_forward, name="training")
    worker.start()
    try:
        entered.wait(10)
        assert rank1.post(rank1.snapshot())
        assert rank1.evidence_given == {record["id"]}
        rank1.post(rank1.snapshot())  # asked again: sent once
    finally:
        release.set()
        worker.join()
    stored = json.loads((tmp_path / "leader" / bundle / "rank1.json").read_text())
    assert stored["decision"] == record["id"] and stored["rank"] == 1
    assert "Thread" in stored["stacks"] and '"training"' in stored["stacks"] and "stuck_in_forward" in stored["stacks"]
    assert stored["spans"][-1][:2] == ["forward", None] and stored["spans"][-1][-1] is None  # open, innermost last
    assert stored["activity"]["kind"] == "forward" and stored["activity"]["rank"] == 1
    assert stored["flight_recorder"]["path"] is None and stored["flight_recorder"]["error"]  # no process group here

    # What does not fit is refused, naming the field.
    body = {"version": 1, "evidence": {**stored, "rank": 0}}
    assert client.post("/v1/evidence", json=body).status_code == 200
    again = client.post("/v1/evidence", json=body)
    assert again.status_code == 409 and "already here" in again.json()["detail"]
    other = client.post("/v1/evidence", json={"version": 1, "evidence": {**stored, "rank": 0, "decision": 999}})
    assert other.status_code == 409 and other.json()["detail"].startswith("evidence.decision")
    run = client.post("/v1/evidence", json={"version": 1, "evidence": {**stored, "rank": 0, "run_id": "r2"}})
    assert run.status_code == 409 and run.json()["detail"].startswith("evidence.run_id")
    outside = client.post("/v1/evidence", json={"version": 1, "evidence": {**stored, "rank": 5}})
    assert outside.status_code == 409 and outside.json()["detail"].startswith("evidence.rank")
    bad = client.post("/v1/evidence", json={"version": 1, "evidence": {**stored, "spans": [["forward"]] * 65}})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("evidence.spans")
    assert client.post("/v1/evidence", json=body, headers={"Authorization": ""}).status_code == 401

    status = client.get("/v1/hang").json()["evidence"][-1]
    assert (status["decision"], status["bundle"], status["ranks"], status["expected"]) == (
        record["id"],
        bundle,
        [0, 1],
        [0, 1],
    )
    # Shown where operators look: /v1/status, `parwatch decisions` and `parwatch status`, the report.
    assert client.get("/v1/status").json()["evidence"][-1]["ranks"] == [0, 1]
    assert f"evidence_in=STATE_DIR/{bundle}" in _decision_line(logged[-1])
    assert _hang_line(client.get("/v1/hang").json()).endswith(f"; evidence in STATE_DIR/{bundle}")
    (tmp_path / "run").mkdir()
    run = load_run(tmp_path / "run", tmp_path / "leader" / "decisions.jsonl")
    assert _evidence_lines(run) == [
        f"Evidence of decision {record['id']} (hang, step 3): {tmp_path / 'leader' / bundle} holds ranks 0, 1."
    ]


def _two_nodes(tmp_path):
    """A leader holding rank 0 and a node holding rank 1 (its digests reach the leader with its node
    credential): rank 1 stays in its forward, rank 0 waits for it, the leader names the hang."""
    leader, lsc, lclock = _app(tmp_path, "leader")
    node, nsc, nclock = _app(tmp_path, "node", leader_url="http://leader")
    hub = nsc.activity
    hub._http = _Bridge(leader)
    for step in (1, 2, 3):
        lclock.t += 1
        nclock.t += 1
        leader.post("/v1/activity", json=report(0, step=step, time=lclock.t, step_end=lclock.t, host="leader-host"))
        node.post("/v1/activity", json=report(1, step=step, time=nclock.t, step_end=nclock.t))
        asyncio.run(hub.tick())
    for _ in range(5):  # rank 1 (node) stuck in its forward; rank 0 waits for it
        lclock.t += 1
        nclock.t += 1
        leader.post(
            "/v1/activity",
            json=report(0, kind="recv", peer=1, op="recv", group="pp", time=lclock.t, host="leader-host"),
        )
        node.post("/v1/activity", json=report(1, kind="forward", time=nclock.t))
        asyncio.run(hub.tick())
        asyncio.run(lsc.activity.tick())
    [record] = [d for d in lsc.activity.monitor.findings if d["rule"] == "hang"]
    asyncio.run(hub.tick())  # the digest's reply carries the ask
    return leader, node, nsc, nclock, record


def test_a_node_asks_its_ranks_and_forwards_their_evidence_to_the_leader(tmp_path):
    leader, node, nsc, nclock, record = _two_nodes(tmp_path)
    reply = node.post("/v1/activity", json=report(1, kind="forward", time=nclock.t)).json()
    assert reply["evidence"] == {"decision": record["id"]}
    rank1 = _reporter(node, 1, HookRegistry(), nclock)
    assert rank1.give_evidence(record["id"])
    stored = json.loads((tmp_path / "leader" / record["evidence"]["bundle"] / "rank1.json").read_text())
    assert stored["rank"] == 1 and "test_a_node_asks_its_ranks" in stored["stacks"]
    assert not (tmp_path / "node" / "evidence").exists()  # kept at the leader only


def _evidence(rank: int, decision: int, run_id: str = "r1") -> dict:
    activity = report(rank, kind="forward", time=1_000.0)["activity"]
    body = {"run_id": run_id, "decision": decision, "rank": rank, "time": 1_000.0, "activity": activity}
    return {"version": 1, "evidence": body | {"stacks": "Thread 1 (most recent call last):\n", "spans": []}}


def _as(credential: str) -> dict:
    return {"Authorization": f"Bearer {credential}"}


def test_a_rank_credential_posts_only_its_own_rank_of_its_own_run_that_reports_here(tmp_path):
    client, sidecar, clock = _app(tmp_path, "leader")
    decision = _hang(client, sidecar, clock)["id"]
    rank0 = _as(rank_credential("tok", "r1", 0))
    other = client.post("/v1/evidence", json=_evidence(1, decision), headers=rank0)
    assert other.status_code == 403, other.text
    assert other.json()["detail"] == (
        "evidence.rank: rank 1 of run 'r1', but this credential speaks for rank 0 of run 'r1' only"
    )
    another_run = client.post("/v1/evidence", json=_evidence(0, decision), headers=_as(rank_credential("tok", "r2", 0)))
    assert another_run.status_code == 403 and another_run.json()["detail"].startswith("evidence.run_id: "), (
        another_run.text
    )
    assert client.post("/v1/evidence", json=_evidence(0, decision), headers=rank0).status_code == 200
    bundle = tmp_path / "leader" / f"evidence/r1/decision-{decision}"
    assert sorted(p.name for p in bundle.iterdir()) == ["rank0.json"]  # nothing refused was kept


def test_a_rank_posts_its_evidence_where_it_reports_and_a_node_only_the_ranks_its_digests_carry(tmp_path):
    leader, node, _, _, record = _two_nodes(tmp_path)
    decision = record["id"]
    # Rank 0 reports to the leader: the node has never heard of it.
    elsewhere = node.post("/v1/evidence", json=_evidence(0, decision), headers=_as(rank_credential("tok", "r1", 0)))
    assert elsewhere.status_code == 409, elsewhere.text
    assert elsewhere.json()["detail"].startswith("evidence.rank: rank 0 reports no activity to this sidecar")
    # The node's digests carry rank 1 only: rank 0's evidence is not its to forward, nor any rank an unknown node's.
    name = node_credential("tok", f"{socket.gethostname()}:9401")
    not_its = leader.post("/v1/evidence", json=_evidence(0, decision), headers=_as(name))
    assert not_its.status_code == 403, not_its.text
    assert not_its.json()["detail"] == (
        f"evidence.rank: node '{socket.gethostname()}:9401' forwards only the ranks its digests carry ([1]), not rank 0"
    )
    stranger = leader.post("/v1/evidence", json=_evidence(1, decision), headers=_as(node_credential("tok", "x:1")))
    assert (
        stranger.status_code == 403
        and "node 'x:1' forwards only the ranks its digests carry ([])" in (stranger.json()["detail"])
    )
    assert not (tmp_path / "leader" / record["evidence"]["bundle"]).exists()  # nothing refused was kept
    assert leader.post("/v1/evidence", json=_evidence(1, decision), headers=_as(name)).status_code == 200


def test_the_launcher_turns_the_flight_recorder_on_unless_the_user_chose_a_size():
    env: dict = {}
    assert enable_flight_recorder(env)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert not enable_flight_recorder(mine) and mine == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
