"""/v1/activity, /v1/digest and /v1/hang on the control app (FastAPI TestClient, real sidecar object):
authentication, field-naming 422s, a node forwarding its digest to the leader, rank-missing on time."""

import asyncio
import os

import msgspec
import pytest
from fastapi.testclient import TestClient

from parwatch.rank_layout import RankLayout
from parwatch.sidecar.activity_api import FINAL_SUMMARIES_SECONDS, _next_ask, _woken_to_forward
from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import ConfigError, Listen, SidecarConfig
from parwatch.sidecar.hang import JUDGE_EVERY_SECONDS
from parwatch.sidecar.service import build_sidecar
from parwatch.wire.activity import ActivityPost
from parwatch.wire.codec import parse
from parwatch.wire.steps import StepSummary
from tests.fixtures import synthetic as syn
from tests.loop_turns import run_beside_other_work


class Clock:
    def __init__(self):
        self.t = 1_000.0

    def __call__(self):
        return self.t


def report(rank, step=3, kind="forward", pid=None, state="running", host="elsewhere", **kw):
    a = {
        "run_id": "r1",
        "rank": rank,
        "pid": pid or 10_000 + rank,
        "host": host,
        "stage": rank,
        "tp_rank": 0,
        "dp_rank": 0,
        "tp": 1,
        "pp": 2,
        "dp": 1,
        "state": state,
        "step": step,
        "step_seconds": 0.1,
        "kind": kind,
        "op": None,
        "group": None,
        "peer": None,
        "seq": None,
        "since": 990.0,
        "time": 1000.0,
    }
    a.update(kw)
    return {"version": 1, "activity": a}


def typed(body: dict) -> ActivityPost:
    return msgspec.convert(body, ActivityPost)


TEN_SECONDS = {"hang_min_seconds": 10.0, "hang_step_factor": 3.0}
"""The hang bound these timelines were written for (the default until issue 44): the mechanism, not the default."""


def _client(tmp_path, name, **cfg):
    clock = Clock()
    cfg = {**TEN_SECONDS, **cfg}
    config = SidecarConfig(
        state_dir=tmp_path / name,
        token="tok",
        control_listen=Listen("127.0.0.1", 9401),
        metrics_listen=Listen("127.0.0.1", 9400),
        **cfg,
    )
    sidecar = build_sidecar(config, clock=clock)
    app = create_control_app(sidecar)
    return TestClient(app, headers={"Authorization": "Bearer tok"}), sidecar, clock


def test_activity_needs_the_token_and_names_bad_fields(tmp_path):
    client, sidecar, _ = _client(tmp_path, "s")
    assert client.post("/v1/activity", json=report(0), headers={"Authorization": ""}).status_code == 401
    r = client.post("/v1/activity", json={"version": 1, "activity": {"rank": None, "tp": 1, "pp": 1, "dp": 1}})
    assert r.status_code == 422 and "activity.rank" in r.json()["detail"]
    bad = report(5)
    r = client.post("/v1/activity", json=bad)
    assert r.status_code == 422 and "activity.rank must be an integer in 0..1" in r.json()["detail"]
    assert client.post("/v1/activity", content=b"{nope").status_code == 422
    assert client.post("/v1/activity", json=report(1)).json() == {"ok": True}
    r = client.post("/v1/digest", json={"version": 1, "node": "", "layout": [1, 1, 1], "rows": []})
    assert r.status_code == 422 and "digest.node" in r.json()["detail"]
    for bad_end in ("soon", -1.0, 1e300, True):
        r = client.post("/v1/activity", json=report(1, step_end=bad_end))
        assert r.status_code == 422 and "activity.step_end" in r.json()["detail"], (bad_end, r.text)
    assert client.post("/v1/activity", json=report(1, step_end=999.5)).json() == {"ok": True}
    assert sidecar.activity.book.rows()[1].step_end == 999.5


def test_leader_names_a_hang_within_the_bound_of_the_ranks_step_boundary(tmp_path):
    """The stall is timed from when the ranks ended the last step (activity.step_end), not from when
    the leader heard of it: here 1.6 s later, with a node's digest whose row tells no step_end."""
    leader, lsc, clock = _client(tmp_path, "leader")
    hub = lsc.activity
    for step in (1, 2, 3):
        clock.t += 1
        leader.post(
            "/v1/activity",
            json=report(0, step=step, kind="forward", host="leader-host", time=clock.t - 0.6, step_end=clock.t - 1.6),
        )
    boundary = clock.t - 1.6

    def reports():  # once a second, as the ranks and the node do while rank 1 hangs
        row_b = [
            1,
            "running",
            "forward",
            None,
            None,
            None,
            None,
            boundary + 0.01,
            3,
            0.1,
            10_001,
            "node-b",
            1,
            0,
            0,
            clock.t,
            None,
        ]  # rank 1's row tells no step_end: the stall is timed from rank 0's
        assert leader.post(
            "/v1/digest",
            json={
                "version": 1,
                "node": "node-b:9401",
                "run_id": "r1",
                "time": clock.t,
                "layout": [1, 2, 1],
                "rows": [row_b],
            },
        ).json() == {"ok": True}
        leader.post(
            "/v1/activity",
            json=report(
                0,
                step=3,
                kind="recv",
                peer=1,
                op="recv",
                group="pp",
                host="leader-host",
                time=clock.t,
                step_end=boundary,
            ),
        )

    reports()
    assert hub.status(hub.rows())["stalled_seconds"] == pytest.approx(1.6)
    assert _next_ask(hub) == JUDGE_EVERY_SECONDS  # the line (the bound) is 8.4 s away
    decided = None
    while decided is None and clock.t < boundary + 12:
        clock.t += 0.25  # the asks between ticks: judge(), as the loop does every JUDGE_EVERY_SECONDS
        if clock.t % 1.0 == 0.0:
            reports()
        for record in asyncio.run(hub.judge()):
            decided = record
    assert decided is not None and decided["rule"] == "hang" and decided["evidence"]["culprit"]["rank"] == 1
    assert decided["evidence"]["culprit"]["host"] == "node-b"
    assert 10.0 <= clock.t - boundary <= 10.0 + 0.25  # at the bound of the boundary, at most one ask late


def test_a_late_digest_at_the_decision_line_holds_the_hang_back_one_ask_not_a_second(tmp_path):
    """A node's digest sampled before the stall began (late) holds the decision back; the next ask after a
    fresh one decides, not the next once-a-second tick."""
    leader, lsc, clock = _client(tmp_path, "leader")
    hub = lsc.activity
    boundary = clock.t

    def digest(kind, sampled):
        row = [1, "running", kind, None, None, None, None, boundary - 0.5, 3, 0.1, 10_001, "node-b", 1, 0, 0]
        body = {"version": 1, "node": "node-b:9401", "run_id": "r1", "time": clock.t, "layout": [1, 2, 1]}
        assert leader.post("/v1/digest", json={**body, "rows": [[*row, sampled, boundary]]}).json() == {"ok": True}

    rank0 = dict(kind="recv", peer=1, op="recv", group="pp", host="leader-host", step_end=boundary)
    leader.post("/v1/activity", json=report(0, step=3, time=boundary, **rank0))
    clock.t = boundary + 10.0  # the decision line: the bound
    leader.post("/v1/activity", json=report(0, step=3, time=clock.t, **rank0))
    digest("forward", sampled=boundary - 1.5)  # sampled before the boundary: a late digest
    assert asyncio.run(hub.judge(full=True)) == []  # a stale picture: no culprit named from it
    assert _next_ask(hub) == JUDGE_EVERY_SECONDS
    clock.t += JUDGE_EVERY_SECONDS
    digest("backward", sampled=clock.t)  # rank 1 since before the boundary, sampled now
    [record] = asyncio.run(hub.judge())  # the next ask, between ticks
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1
    assert clock.t - boundary == 10.0 + JUDGE_EVERY_SECONDS  # one ask after the line


def test_the_leader_answers_posts_between_the_slices_of_its_survey(tmp_path, monkeypatch):
    """At 16,384 ranks the judgement's passes over every rank held the leader's loop for 20-60 ms at once, and
    every digest posted meanwhile waited: the leader takes them SURVEY_SLICE ranks at a time, and the loop
    runs other work between the slices, before the picture is judged."""
    import parwatch.sidecar.hang as hang

    monkeypatch.setattr(hang, "SURVEY_SLICE", 1)  # two ranks: two slices
    leader, lsc, clock = _client(tmp_path, "leader")
    hub = lsc.activity
    boundary = clock.t
    rank0 = dict(kind="recv", peer=1, op="recv", group="pp", host="leader-host", step_end=boundary)
    leader.post("/v1/activity", json=report(0, step=3, time=boundary, **rank0))
    clock.t = boundary + 10.0
    leader.post("/v1/activity", json=report(0, step=3, time=clock.t, **rank0))
    row = [1, "running", "backward", None, None, None, None, boundary - 0.5, 3, 0.1, 10_001, "node-b", 1, 0, 0]
    body = {"version": 1, "node": "node-b:9401", "run_id": "r1", "time": clock.t, "layout": [1, 2, 1]}
    assert leader.post("/v1/digest", json={**body, "rows": [[*row, clock.t, boundary]]}).json() == {"ok": True}
    other_ran, ran_before_judged = [], []
    check = hub.monitor.check
    monkeypatch.setattr(
        hub.monitor, "check", lambda *a, **kw: ran_before_judged.append(len(other_ran)) or check(*a, **kw)
    )

    [record] = run_beside_other_work(hub.judge, other_ran)
    assert record["rule"] == "hang" and record["evidence"]["culprit"]["rank"] == 1
    assert ran_before_judged[0] >= 2  # the other task ran between the slices (the leader's posts, in the sidecar)


def test_the_leader_takes_every_ranks_row_between_posts(tmp_path, monkeypatch):
    """The judgement's and GET /v1/hang's picture of every rank (5-7 ms at once at 16,384 ranks, and the
    slowest digests of the hung phase waited on it) is taken SURVEY_SLICE ranks at a time, other work between."""
    import parwatch.sidecar.activity_api as activity_api

    monkeypatch.setattr(activity_api, "SURVEY_SLICE", 1)
    leader, lsc, clock = _client(tmp_path, "leader")
    hub = lsc.activity
    body = {"version": 1, "run_id": "r1", "time": clock.t, "layout": [1, 2, 1]}
    for rank in (0, 1):
        row = [rank, "running", "backward", None, None, None, None, clock.t, 3, 0.1, 10_000 + rank, f"n{rank}"]
        digest = {**body, "node": f"n{rank}:9401", "rows": [[*row, rank, 0, 0, clock.t, clock.t]]}
        assert leader.post("/v1/digest", json=digest).json() == {"ok": True}
    other_ran: list = []
    assert run_beside_other_work(hub.rows_between_posts, other_ran) == hub.rows() and set(hub.rows()) == {0, 1}
    assert len(other_ran) >= 2  # one node's rows, the other's: the loop ran between
    assert leader.get("/v1/hang").json()["rank_states"] == {"running": 2}


def test_the_leaders_loop_asks_right_at_the_decision_line(tmp_path):
    leader, lsc, clock = _client(tmp_path, "leader")
    hub = lsc.activity
    boundary = clock.t - 0.5

    def rank0():  # a live process here, reporting as it does every second
        leader.post("/v1/activity", json=report(0, step=3, pid=os.getpid(), time=clock.t, step_end=boundary))

    rank0()
    assert hub.is_leader
    clock.t += 9.5 - 0.1  # 0.1 s before the line: bound 10 s - the 0.5 s already stalled
    assert _next_ask(hub) == pytest.approx(0.1)
    clock.t += 0.1 - 1e-4
    rank0()
    assert asyncio.run(hub.judge()) == []  # asked 0.1 ms before the line: not due
    clock.t += 2e-4  # the line passed before the loop reads its next ask: ask now, not one ask late
    assert _next_ask(hub) == 0.0
    [record] = asyncio.run(hub.judge())  # asked past it: decided (rank 0 computes, rank 1 never reported)
    assert record["rule"] == "hang"
    assert _next_ask(hub) == JUDGE_EVERY_SECONDS  # the normal cadence, no spin


def test_leader_from_rank0_names_a_hang_from_a_forwarded_digest(tmp_path):
    leader, lsc, lclock = _client(tmp_path, "leader")
    node, nsc, nclock = _client(tmp_path, "node", leader_url="http://leader")
    hub_node = nsc.activity
    hub_node._http = _Bridge(leader)  # the node's digest POSTs go to the leader app
    # Steps 1..3 go by on both nodes; then rank 1 (on the node) hangs in its forward.
    for step in (1, 2, 3):
        lclock.t += 1
        nclock.t += 1
        leader.post(
            "/v1/activity",
            json=report(0, step=step, kind="recv", peer=1, op="recv", group="pp", host="leader-host", time=lclock.t),
        )
        node.post("/v1/activity", json=report(1, step=step, kind="forward", time=nclock.t))
        asyncio.run(hub_node.tick())
    assert lsc.activity.is_leader and not hub_node.is_leader
    for _ in range(12):
        lclock.t += 1
        nclock.t += 1
        node.post("/v1/activity", json=report(1, step=3, kind="forward", time=nclock.t))
        leader.post(
            "/v1/activity",
            json=report(0, step=3, kind="recv", peer=1, op="recv", group="pp", host="leader-host", time=lclock.t),
        )
        asyncio.run(hub_node.tick())
        asyncio.run(lsc.activity.tick())
    status = leader.get("/v1/hang").json()
    hang = status["hang"]
    assert hang["rule"] == "hang" and hang["evidence"]["culprit"]["rank"] == 1
    assert hang["evidence"]["waiting"] == [0] and status["rank_states"] == {"running": 1, "hung": 1}
    decisions = leader.get("/v1/decisions").json()
    assert any(d.get("rule") == "hang" for d in decisions)


def test_a_node_forwards_a_ranks_first_report_and_its_end_at_once(tmp_path):
    """Found in CI (8ffa4a6): rank 3 raised in the run's first second and its peers' echoes reached the leader
    before node 1's first tick had forwarded anything: rank-gone named no culprit. A node's loop now wakes to
    forward when a rank reports first or changes state, not at its next tick."""
    leader, lsc, lclock = _client(tmp_path, "leader")
    node, nsc, nclock = _client(tmp_path, "node", leader_url="http://leader")
    hub = nsc.activity
    hub._http = _Bridge(leader)
    leader.post("/v1/activity", json=report(0, step=1, host="leader-host", time=lclock.t))

    def woken() -> bool:  # the loop's wait, 5 s at most: True at once when woken
        return asyncio.run(_woken_to_forward(hub, 5.0))

    node.post("/v1/activity", json=report(1, step=1, time=nclock.t))
    assert woken()  # its first report
    asyncio.run(hub._forward())
    assert 1 in lsc.activity.view.rows()
    node.post("/v1/activity", json=report(1, step=2, time=nclock.t))
    assert not hub.forward_soon.is_set()  # still running: the next tick forwards it
    node.post("/v1/activity", json=report(1, step=2, state="crashed", error="InjectedError: boom", time=nclock.t))
    assert woken()  # its end
    asyncio.run(hub._forward())
    assert lsc.activity.view.rows()[1].state == "crashed"


def test_a_run_in_megatrons_order_is_checked_forwarded_and_judged_in_it(tmp_path):
    """TP1 x PP2 x DP2 in Megatron's default order (tp-dp-pp: rank = dp_rank + 2 * stage): ranks 0 and 2 on
    the leader's node, 1 and 3 on another. Reports carry the order; the node's digest forwards it. Rank 3
    hangs in its forward: rank 1 waits for it in a receive, ranks 0 and 2 in Megatron's DP gradient sync."""
    leader, lsc, lclock = _client(tmp_path, "leader")
    node, nsc, nclock = _client(tmp_path, "node", leader_url="http://leader")
    nsc.activity._http = _Bridge(leader)
    where = {0: 0, 1: 0, 2: 1, 3: 1}  # rank -> stage in tp-dp-pp (the default would say 0, 1, 0, 1)
    doing = {
        0: {"kind": "dp_sync", "op": "finalize_model_grads", "group": "dp"},
        1: {"kind": "recv", "op": "recv", "group": "pp", "peer": 3},
        2: {"kind": "dp_sync", "op": "finalize_model_grads", "group": "dp"},
        3: {"kind": "forward"},
    }

    def post(rank, step, order="tp-dp-pp", **kw):
        client, clock = (leader, lclock) if rank in (0, 2) else (node, nclock)
        at = {"stage": where[rank], "dp_rank": rank % 2, "dp": 2, "order": order}
        return client.post("/v1/activity", json=report(rank, step=step, time=clock.t, **at, **{**doing[rank], **kw}))

    refused = post(1, 1, order=None)  # no order: the default's, where rank 1 is stage 1
    assert refused.status_code == 422, refused.text
    assert "rank 1 says tp_rank 0, stage 0, dp_rank 1, but order 'tp-pp-dp'" in refused.json()["detail"]
    for step in (1, 2, 3):
        lclock.t += 1
        nclock.t += 1
        for rank in range(4):
            assert post(rank, step, kind="forward").json()["ok"]
        asyncio.run(nsc.activity.tick())
    assert lsc.activity.view.layout == RankLayout(1, 2, 2, "tp-dp-pp")  # from the node's digest
    changed = post(0, 3, order="tp-pp-dp")  # rank 0 sits alike in both orders: the order itself changed
    assert changed.status_code == 422 and "differs from this run's" in changed.json()["detail"]
    for _ in range(12):
        lclock.t += 1
        nclock.t += 1
        for rank in range(4):
            post(rank, 3)
        asyncio.run(nsc.activity.tick())
        asyncio.run(lsc.activity.tick())
    evidence = leader.get("/v1/hang").json()["hang"]["evidence"]
    culprit = evidence["culprit"]
    assert (culprit["rank"], culprit["stage"], culprit["dp_rank"], culprit["kind"]) == (3, 1, 1, "forward")
    assert evidence["waiting"] == [0, 1, 2]


class _Bridge:
    """An httpx.AsyncClient stand-in that hands requests to a TestClient."""

    def __init__(self, client):
        self.client = client

    async def post(self, url, content, headers):
        return self.client.post(url.replace("http://leader", ""), content=content, headers=headers)

    async def aclose(self):
        pass


def test_crash_then_rank_missing_fires_sixty_seconds_after_the_pid_ended(tmp_path):
    """The issue: after a crash every rank stopped, no observation arrived, and rank-missing never fired.
    Now a dead pid is a down rank at once, rank_up is judged every second, and the rule fires 60 s later."""
    import os
    import socket
    import subprocess
    import sys

    from tests.fixtures import synthetic as syn

    client, sidecar, clock = _client(tmp_path, "s", rank_grace_seconds=30.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    for step in (1, 2, 3):
        clock.t += 1
        r = client.post(
            "/v1/ingest",
            json={
                "version": 1,
                "summaries": [
                    syn.summary(
                        0,
                        step,
                        run_id="r1",
                        time=float(step),
                        global_stages=[syn.stage_view(0, 0.5, 0.4), syn.stage_view(1, 0.5, 0.4)],
                    ),
                    syn.summary(1, step, run_id="r1", time=float(step)),
                ],
            },
        )
        assert r.status_code == 200, r.text
        client.post("/v1/activity", json=report(0, step=step, host=host, pid=os.getpid()))
        client.post("/v1/activity", json=report(1, step=step, host=host, pid=dead.pid))  # rank 1's pid: gone
    hub = sidecar.activity
    fired_at, gone_at = None, None
    for second in range(1, 80):
        clock.t += 1
        for record in asyncio.run(hub.tick()):
            if record["rule"] == "rank-gone" and gone_at is None:
                gone_at = second
        if fired_at is None and any(d.get("rule") == "rank-missing" for d in sidecar.engine.decisions(50)):
            fired_at = second
    assert gone_at == 1  # the crash itself is named at the next tick
    gone = [d for d in sidecar.engine.decisions(50) if d.get("rule") == "rank-gone"][0]
    assert gone["evidence"]["culprit"]["rank"] == 1 and gone["evidence"]["culprit"]["state"] == "gone"
    assert fired_at is not None and 60 <= fired_at <= 62, fired_at
    assert not any(d.get("rule") == "hang" for d in sidecar.engine.decisions(50))


def test_leader_url_must_be_http():
    with pytest.raises(ConfigError, match="--leader-url"):
        SidecarConfig(leader_url="leader:9401")


def test_hang_actions_dump_the_culprits_stacks_and_abort_the_run(tmp_path):
    """--hang-dump-stacks: the culprit's sidecar sends SIGUSR1 (faulthandler writes its stacks);
    --hang-abort: activity replies tell every rank to exit with HANG_EXIT_CODE."""
    import socket
    import subprocess
    import sys
    import time

    from parwatch.wire.activity import HANG_EXIT_CODE

    stacks = tmp_path / "stacks-rank1.txt"
    server = socket.create_server(("127.0.0.1", 0))  # the child's connection proves its pid (pid_owner)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import faulthandler, signal, socket, sys, time\n"
                f"f = open({str(stacks)!r}, 'a')\n"
                "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
                f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\n"
                "print('ready', flush=True)\n"
                "def stuck_in_forward():\n    time.sleep(120)\n"
                "stuck_in_forward()\n"
            ),
        ],
        stdout=subprocess.PIPE,
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # rank 0: never signalled
    try:
        assert child.stdout.readline().strip() == b"ready"
        accepted, child_end = server.accept()
        client, sidecar, clock = _client(tmp_path, "s", hang_dump_stacks=True, hang_abort=True)
        host, hub = socket.gethostname(), sidecar.activity

        def both(step):  # rank 0 names a stranger's pid (never proven); rank 1 reports over its own connection
            client.post(
                "/v1/activity",
                json=report(
                    0, step=step, kind="recv", op="recv", group="pp", peer=1, host=host, pid=bystander.pid, time=clock.t
                ),
            )
            hub.activity(
                typed(report(1, step=step, kind="forward", host=host, pid=child.pid, time=clock.t)), client=child_end
            )

        for step in (1, 2, 3):
            clock.t += 1
            both(step)
        for _ in range(12):
            clock.t += 1
            both(3)
            asyncio.run(hub.tick())
        assert hub.monitor.hang_detected
        deadline = time.monotonic() + 10
        while "stuck_in_forward" not in (stacks.read_text() if stacks.exists() else ""):
            assert time.monotonic() < deadline, "no stack dump from the culprit"
            time.sleep(0.05)
        reply = client.post("/v1/activity", json=report(0, step=3, host=host, pid=bystander.pid, time=clock.t)).json()
        assert reply["abort"] == HANG_EXIT_CODE  # (and the ask for its evidence: test_evidence.py)
        accepted.close()
    finally:
        server.close()
        for p in (child, bystander):
            p.kill()
            p.wait()


def test_an_operator_command_at_a_node_sidecar_names_the_leader(tmp_path):
    """Issue 24, item 9: on 40e8301 a node sidecar answered "no run has reported to this sidecar yet"."""
    node, _, _ = _client(tmp_path, "node", leader_url="http://leader:9401")
    r = node.post("/v1/control", json={"action": "pause", "reason": "t"})
    assert r.status_code == 400 and "--endpoint http://leader:9401" in r.json()["detail"], r.text


def test_a_deliberate_pause_keeps_a_node_sidecars_ranks_up(tmp_path):
    """Issue 24, item 5: on 40e8301 the other node reported its ranks down 30 s into a pause (no summaries
    flow while paused), and ParwatchRankMissing paged after ~90 s. The leader's digest reply now says
    the run is paused, and the node keeps its ranks up."""
    from tests.fixtures import synthetic as syn

    leader, lsc, lclock = _client(tmp_path, "leader")
    node, nsc, nclock = _client(tmp_path, "node", leader_url="http://leader", rank_grace_seconds=30.0)
    nsc.activity._http = _Bridge(leader)
    node.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(1, 1)]})
    leader.post("/v1/activity", json=report(0, host="leader-host", time=lclock.t))
    lsc.engine.policy.run.paused = True  # the run is paused (as after a pause directive's outcome)
    for _ in range(40):  # 40 s of pause: no summaries anywhere
        nclock.t += 1
        lclock.t += 1
        node.post("/v1/activity", json=report(1, step=1, time=nclock.t))
        asyncio.run(nsc.activity.tick())
    assert nsc.activity.leader_paused and nsc.store.liveness() == {1: True}


def test_a_node_signals_only_pids_its_own_ranks_reported(tmp_path, monkeypatch):
    """Issue 25, item 2: the leader's reply asks a node to SIGUSR1 pids; the node signals a pid only when a
    running rank of this run reported it over a connection that pid's own process holds (pid_owner)."""
    import os
    import socket

    from parwatch.sidecar import activity_api

    sent = []
    monkeypatch.setattr(activity_api, "_signal", sent.append)
    node, nsc, _ = _client(tmp_path, "node", leader_url="http://leader")
    hub = nsc.activity
    me = os.getpid()  # this process stands in for rank 1 and holds its connection
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        accepted, my_end = server.accept()
        hub.activity(typed(report(1, host=hub.hostname, pid=me)), client=my_end)
        hub.activity(typed(report(0, host=hub.hostname, pid=os.getppid())), client=my_end)  # a pid not holding it
        accepted.close()
    r = node.post("/v1/activity", json=report(0, host=hub.hostname, pid=os.getppid()))  # claimed, never proven
    assert r.status_code == 200
    for pid in (me, os.getppid(), 1):
        hub._signal_own(pid)
    assert sent == [me]


def _done_at_12_holding_11(client, store) -> None:
    """Run r1's ranks 0 and 1: the store holds their step 11, then both say done at step 12."""
    for rank in (0, 1):
        summary = parse(syn.summary(rank, 11, run_id="r1", time=990.0), StepSummary)
        store.admit([summary])
        store.add(summary)
    for rank in (0, 1):
        assert client.post("/v1/activity", json=report(rank, step=12, state="done")).status_code == 200


def test_the_run_ends_once_the_last_summaries_of_its_done_ranks_are_in(tmp_path):
    """A rank says done before its shipper flushes its last summaries (the collector closes the activity
    reporter first): the run's end (the trackers' final point, another run taking over) waits for them,
    and no longer than FINAL_SUMMARIES_SECONDS when they were lost. CI once wrote a run's final point at
    step 11 of 12."""
    for lost in (False, True):
        client, sidecar, clock = _client(tmp_path, f"s{lost}")
        store = sidecar.store
        _done_at_12_holding_11(client, store)
        assert not store.ended  # both said done at step 12; the sidecar holds step 11
        if lost:
            clock.t += FINAL_SUMMARIES_SECONDS
        else:
            for rank in (0, 1):
                store.add(parse(syn.summary(rank, 12, run_id="r1", time=991.0), StepSummary))
        sidecar.activity._feed_liveness()  # the once-a-second tick
        assert store.ended


def test_the_next_runs_first_post_is_taken_as_soon_as_the_last_ones_final_summaries_are_in(tmp_path):
    """CI on 3fe2cd0: ranks finishing run A and starting run B at once; A's last summaries came in, and B's
    first, 0.2 s later and before the once-a-second tick noticed A's end, was refused 409 ("A is live
    here"); B's check records were then refused for ever and its pause never reached the operator."""
    client, sidecar, clock = _client(tmp_path, "handover")
    store = sidecar.store
    _done_at_12_holding_11(client, store)
    for rank in (0, 1):  # the shipper's last post of run r1
        store.add(parse(syn.summary(rank, 12, run_id="r1", time=991.0), StepSummary))
    clock.t += 0.2
    first = [syn.summary(rank, 1, run_id="r2", time=991.2) for rank in (0, 1)]
    r = client.post("/v1/ingest", json={"version": 1, "summaries": first})
    assert r.status_code == 200, r.text
    assert store.run_id == "r2"


def test_a_restarted_rank_is_up_from_its_first_summary_not_down_until_its_first_activity(tmp_path):
    """A restart's first summaries reach the sidecar before its first activity report (a second later, or
    only its last word when it lives less): the old process's "crashed" row kept the rank down meanwhile.
    Seen in test_restart_ledger under load: rank_up{rank="0"} 0 across the whole resumed run."""
    client, sidecar, clock = _client(tmp_path, "restart")
    store = sidecar.store

    def post(step: int, started: float) -> None:
        summary = parse({**syn.summary(0, step, run_id="r1", time=clock.t), "process_start_time": started}, StepSummary)
        store.admit([summary])
        store.add(summary)

    post(5, started=900.0)
    assert client.post("/v1/activity", json=report(0, step=5, state="crashed")).status_code == 200
    sidecar.activity._feed_liveness()
    assert store.liveness()[0] is False  # its process crashed
    clock.t = 1_030.0
    post(4, started=1_005.0)  # the restarted process, resumed from checkpoint 3
    assert store.liveness()[0] is True  # at once, not at the next tick
    sidecar.activity._feed_liveness()
    assert store.liveness()[0] is True  # the crashed row tells of the process before it


def test_rank_0s_first_summary_makes_a_lone_sidecar_the_leader_at_once(tmp_path):
    """Not at the next once-a-second tick: CI on 903509b wrote a short run's tracker point, at its last step,
    before the tick had seen rank 0, so the point lacked hang_detected, which /metrics showed a moment later."""
    client, sidecar, _ = _client(tmp_path, "lone")
    r = client.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(0, 1, run_id="r1", time=1_000.0)]})
    assert r.status_code == 200, r.text
    assert sidecar.activity.is_leader
    node, nsc, _ = _client(tmp_path, "node", leader_url="http://leader")
    r = node.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(0, 1, run_id="r1", time=1_000.0)]})
    assert r.status_code == 200, r.text
    assert not nsc.activity.is_leader  # a node sidecar forwards; rank 0's summaries do not make it lead
