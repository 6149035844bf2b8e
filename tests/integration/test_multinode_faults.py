"""Faults across two loopback nodes told truly (issue 24): a lost leader, a long pause, a node the
leader cannot see. Each node is its own `torchrun --nnodes 2 --node-rank K` with its own sidecar
(test_multinode.py's Node): node 0's sidecar is the leader (it receives rank 0), node 1's forwards
to it with --leader-url, or, where a test says so, has none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from e2e_util import TORCHRUN, read_jsonl, synthetic, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_multinode import HEADERS, TOKEN, Node, finish, torchrun_nodes

from parwatch.cli.control import status as status_command
from parwatch.collector.fallback import LOCAL_DECISIONS_FILE
from tests import one_client

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python"),
]
UNREACHABLE = "parwatch_leader_unreachable_since_timestamp_seconds"
SHORT_HANG = ("--hang-min-seconds", "2")
"""The leader's hang bound where the bound is not under test (test_hang_e2e.py tests the default 10 s)."""


@contextlib.contextmanager
def nodes(base: Path, leader_args=(), node1_args=(), linked: bool = True):
    leader = Node(base, "node0", *leader_args)
    link = ("--leader-url", leader.control_url) if linked else ()
    both = [leader, Node(base, "node1", *link, *node1_args)]
    try:
        yield [n.start() for n in both]
    finally:
        for n in both:
            n.stop()


def cli_status(node: Node) -> str:
    result = CliRunner().invoke(status_command, ["--endpoint", node.control_url], env={"PARWATCH_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    return result.output


def gauge(node: Node, name: str) -> float | None:
    return node.samples(name).get(())


def refused(node: Node) -> dict:
    """{(post, reason): count} of parwatch_posts_refused_total on the node's /metrics."""
    return {
        (s.labels["post"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(node.metrics())
        for s in f.samples
        if s.name == "parwatch_posts_refused_total"
    }


def rank0_summary(base: Path, step: int) -> dict | None:
    return next(
        (
            s
            for s in read_jsonl(base / "log0" / "summaries.jsonl")
            if s["rank"] == 0 and s["step"] == step and s.get("timeline", 0) == 0
        ),
        None,
    )


NAN_STEP = 24
ACT_WITHIN_S = 15.0


def leader_lost(base: Path) -> dict:
    """The leader's sidecar SIGKILLed two steps before a NaN; rank 0 pauses the run itself; the leader is
    then restarted and the run finished: what node 1, rank 0 and the returning leader said and did."""
    seen: dict = {}
    slow = f"straggler:stage=0,ms=250,from_step={NAN_STEP - 3}"  # ~1 s steps around the NaN: a kill lands before it
    with nodes(base) as (leader, node1):
        with torchrun_nodes(
            base,
            [leader, node1],
            NAN_STEP + 4,
            "--pre-step-check",
            "off",
            "--inject",
            f"nan:step={NAN_STEP}",
            "--inject",
            slow,
        ) as procs:
            wait_until(lambda: (leader.status()["last_step"] or 0) >= NAN_STEP - 3, "the leader at the slow steps", 150)
            leader.kill()
            assert rank0_summary(base, NAN_STEP) is None, "killed too late: the NaN step had already run"

            # Node 1 says its leader is gone: status, metric and the operator's command.
            seen["link"] = wait_until(
                lambda: (
                    (node1.status()["leader_link"] or {}).get("unreachable_since") and node1.status()["leader_link"]
                ),
                "node 1 to say the leader is unreachable",
                30,
            )
            seen["unreachable_gauge"] = gauge(node1, UNREACHABLE)
            seen["status_text"] = cli_status(node1)

            # Rank 0 acts on the NaN by itself: a pause every rank applies at one boundary.
            seen["local"] = wait_until(
                lambda: read_jsonl(base / "log0" / LOCAL_DECISIONS_FILE), "rank 0's local decision", 60
            )
            seen["nan"] = rank0_summary(base, NAN_STEP)
            time.sleep(3.0)  # held: nobody trains past the boundary it paused at
            seen["trained_to"] = [
                max(s["step"] for s in read_jsonl(base / f"log{k}" / "summaries.jsonl")) for k in (0, 1)
            ]

            restarted = time.time()
            leader.start()  # same state dir and ports
            (rolled,) = wait_until(
                lambda: [r for r in leader.records("applied") if r.get("action") == "rollback"],
                "the returning leader's rollback applied",
                90,
            )
            seen["rollback_after_restart_s"] = rolled["time"] - restarted
            finish(base, procs)
        seen["decisions"] = leader.records("decision")
        seen["applied"] = leader.records("applied")
        wait_until(lambda: node1.status()["leader_link"]["reachable"], "node 1 to reach the leader again", 30)
        seen["gauges_after"] = (gauge(node1, UNREACHABLE), gauge(leader, UNREACHABLE))
        seen["node1_records"] = node1.records()
    seen["leader_url"] = leader.control_url
    return seen


def test_leader_lost_rank0_pauses_on_a_nan_and_the_returning_leader_rolls_back_once(tmp_path):
    """Node 1 says the leader is unreachable (status, metric, `parwatch status`, which prints no rule state
    it does not judge); rank 0 pauses every rank at one boundary; the leader restarted adopts that
    decision and rolls back exactly once; rank 0's pause comes within ACT_WITHIN_S of the NaN. Beside the
    other tests, in the parallel phase: the bound is the guardrail's promise under load, and it has the margin
    for it (1.1 s on a quiet machine against 15 s; until 2026-12-07 a run of its own in the serial phase
    measured it, 16 s of CI's wall and 15 s of CPU for a figure 13 times under its bound)."""
    seen = leader_lost(tmp_path)
    (local,) = seen["local"]
    link, text = seen["link"], seen["status_text"]
    assert link["reachable"] is False and link["url"] == seen["leader_url"], link
    assert seen["unreachable_gauge"] == pytest.approx(link["unreachable_since"])
    assert "unreachable since" in text and "judged by the leader" in text, text
    assert "rule nonfinite-loss" not in text, text  # node 1 judges no rule: it must not print "ok"
    assert (local["step"], local["action"], local["rule"]) == (NAN_STEP, "pause", "nonfinite-loss"), local
    assert local["time"] - seen["nan"]["time"] <= ACT_WITHIN_S, local["time"] - seen["nan"]["time"]
    assert max(seen["trained_to"]) <= NAN_STEP + 1, f"a node trained on after the local pause: {seen['trained_to']}"
    rollbacks = [d for d in seen["decisions"] if d["action"] == "rollback"]
    assert len(rollbacks) == 1, rollbacks  # one event, one rollback
    assert rollbacks[0]["rule"] == "nonfinite-loss" and rollbacks[0]["checkpoint"] == NAN_STEP - 4, rollbacks
    (adopted,) = [d for d in seen["decisions"] if d.get("local")]
    assert (adopted["source"], adopted["action"], adopted["directive_id"]) == ("rank0", "pause", local["directive_id"])
    assert [r for r in seen["applied"] if r["directive_id"] == local["directive_id"]]
    assert seen["gauges_after"] == (0.0, 0.0)
    assert seen["node1_records"] == []  # node 1 decides nothing, then or now
    print(
        f"NaN step {NAN_STEP} to rank 0's local pause: {local['time'] - seen['nan']['time']:.2f} s; leader "
        f"restarted to the rollback applied: {seen['rollback_after_restart_s']:.2f} s"
    )


def _short_rules(base: Path, for_seconds: int) -> Path:
    """The packaged rules with rank-missing's for_seconds shortened (the test keeps the thresholds' ratio)."""
    from parwatch.sidecar import config

    text = (Path(config.__file__).parent / "default_rules.yaml").read_text()
    assert "    for_seconds: 60\n" in text
    path = base / "rules.yaml"
    path.write_text(text.replace("    for_seconds: 60\n", f"    for_seconds: {for_seconds}\n"))
    return path


GRACE_S, MISSING_FOR_S, PAUSE_S = 4, 8, 13
"""--rank-grace-seconds 30, rank-missing for_seconds 60 and a 100 s pause, scaled by ~1/7 (ranks report
activity every second, so a silent rank is 4 missed reports from being down)."""


def test_a_long_pause_and_a_hang_leave_every_rank_up_and_rank_missing_silent(tmp_path):
    rules = _short_rules(tmp_path, MISSING_FOR_S)
    args = ("--rank-grace-seconds", str(GRACE_S), "--rules", str(rules))
    with nodes(tmp_path, (*args, *SHORT_HANG), args) as (leader, node1):
        with torchrun_nodes(tmp_path, [leader, node1], 200, "--inject", "hang:rank=3,step=30,where=compute"):
            wait_until(lambda: (leader.status()["last_step"] or 0) >= 3, "training", 150)
            leader.control("pause", reason="a long deliberate pause")
            wait_until(lambda: leader.status()["paused"], "the pause applied", 60)
            # The leader judges the whole world: its rank_up covers node 1's ranks too.
            wait_until(
                lambda: set(leader.samples("parwatch_rank_up")) == {("0",), ("1",), ("2",), ("3",)},
                "the leader's rank_up over all four ranks",
                15,
            )
            ends = time.monotonic() + PAUSE_S
            while time.monotonic() < ends:
                for node, ranks in ((leader, {"0", "1", "2", "3"}), (node1, {"2", "3"})):
                    up = node.samples("parwatch_rank_up")
                    assert {r for (r,) in up} == ranks and all(v == 1.0 for v in up.values()), (node.log, up)
                    assert all(r["up"] for r in node.status()["ranks"].values()), node.status()["ranks"]
                time.sleep(1.0)
            leader.control("resume")
            wait_until(lambda: not leader.status()["paused"], "the resume applied", 60)

            # Rank 3 hangs: the others wait on it, alive. The hang rule names it; rank-missing names nobody.
            hang = wait_until(lambda: [d for d in leader.records("decision") if d["rule"] == "hang"], "the hang", 120)
            assert hang[0]["evidence"]["culprit"]["rank"] == 3, hang[0]["reason"]
            time.sleep(max(0.0, GRACE_S + MISSING_FOR_S + 4 - (time.time() - hang[0]["evidence"]["stalled_since"])))
            assert all(v == 1.0 for v in leader.samples("parwatch_rank_up").values())
            assert node1.samples("parwatch_guardrail_state") == {} and leader.samples("parwatch_guardrail_state")
        assert not [d for d in leader.records("decision") if d["rule"] == "rank-missing"]
        assert node1.records() == []


def test_a_node_without_leader_url_is_told_and_no_unseen_rank_is_named(tmp_path):
    """Node 1 started without --leader-url, rank 3 hung: the leader names no culprit among ranks it
    cannot see and says it sees 2 of 4; node 1 warns (log, status, metric). Posts refused for a wrong
    token are counted where they are refused: a digest at the leader, a rank's activity at node 1."""
    with nodes(tmp_path, SHORT_HANG, linked=False) as (leader, node1):
        with torchrun_nodes(tmp_path, [leader, node1], 200, "--inject", "hang:rank=3,step=8,where=compute"):
            (hang,) = wait_until(
                lambda: [d for d in leader.records("decision") if d["rule"] == "hang"], "the hang", 150
            )
            evidence = hang["evidence"]
            assert evidence["culprit"] is None, hang["reason"]  # it has no rows of ranks 2 and 3
            assert evidence["points_at"]["rank"] in (2, 3) and evidence["coverage"]["ranks_seen"] == 2, evidence
            assert "sees 2 of 4 ranks" in hang["reason"]
            link = wait_until(lambda: node1.status()["leader_link"], "node 1's warning", 30)
            assert link["url"] is None and "no --leader-url" in link["error"] and "[2, 3]" in link["error"], link
            assert gauge(node1, UNREACHABLE) == pytest.approx(link["unreachable_since"])
            assert "WARNING: leader (no --leader-url) unreachable since" in cli_status(node1)
            assert "no --leader-url" in node1.log.read_text()
            assert node1.status()["rules"] is None  # it judges nothing; it says so instead of "ok"
            assert node1.samples("parwatch_guardrail_state") == {}  # nor an idle "ok" on its /metrics
            assert ("nonfinite-loss",) in leader.samples("parwatch_guardrail_state")  # the leader judges

            wrong = {"Authorization": "Bearer not-the-token"}
            r = one_client.post(f"{leader.control_url}/v1/digest", json={"version": 1}, headers=wrong, timeout=10)
            assert r.status_code == 401
            r = one_client.post(f"{node1.control_url}/v1/activity", json={"version": 1}, headers=wrong, timeout=10)
            assert r.status_code == 401
            assert refused(leader)[("digest", "unauthorized")] == 1.0
            assert refused(node1)[("activity", "unauthorized")] == 1.0
            (told,) = node1.status()["refused"]
            assert (told["post"], told["reason"], told["count"]) == ("activity", "unauthorized", 1)
            assert "refused node sidecars' digests" in leader.log.read_text()
            r = one_client.post(f"{leader.control_url}/v1/digest", json={"version": 7}, headers=HEADERS, timeout=10)
            assert r.status_code == 422
            assert refused(leader)[("digest", "invalid")] == 1.0


def test_a_whole_node_lost_is_rank_gone_naming_its_ranks_not_a_hang(tmp_path):
    """Issue 24 item 4: on 40e8301 a node lost whole (its ranks and its sidecar) was reported as a hang at
    20 s. Node 1's launcher, ranks and sidecar SIGKILLed mid-run: the leader records rank-gone (no hang),
    pointing at node 1's ranks, with its coverage (the node missing, since when)."""
    from e2e_util import kill_tree

    with nodes(tmp_path) as (leader, node1):  # the default bound: a lost node must be named before it
        with torchrun_nodes(tmp_path, [leader, node1], 400) as procs:
            wait_until(lambda: (leader.status().get("last_step") or 0) >= 6, "step 6 at the leader", 120)
            killed_at = time.time()
            kill_tree(procs[1].pid)
            node1.kill()
            (gone,) = wait_until(
                lambda: [d for d in leader.records("decision") if d["rule"] in ("rank-gone", "hang")][:1],
                "a finding about the lost node",
                120,
            )
            # The leader's hang check judged the stopped run past its bound (and once more): a wrong hang
            # finding is made by now.
            wait_until(
                lambda: (h := leader_hang(leader))["checked_stall_seconds"] >= h["bound_seconds"] + 1.0,
                "the leader's hang check past its bound",
                60,
            )
            findings = [d for d in leader.records("decision") if d["rule"] in ("rank-gone", "hang")]
    assert gone["rule"] == "rank-gone", gone["reason"]
    assert not [d for d in findings if d["rule"] == "hang"], [d["reason"] for d in findings]
    evidence = gone["evidence"]
    named = evidence["culprit"]["rank"] if evidence.get("culprit") else (evidence.get("points_at") or {}).get("rank")
    assert named in (2, 3), evidence
    missing = evidence["coverage"]["nodes_missing"]
    assert [m["node"] for m in missing] == [f"127.0.0.1:{node1.control_port}"] or len(missing) == 1, evidence
    assert gone["time"] - killed_at < 20, gone["time"] - killed_at


def leader_hang(node: Node) -> dict:
    return one_client.get(f"{node.control_url}/v1/hang", headers=HEADERS, timeout=10).json()


def _logged_time(path: Path, pattern: str) -> float | None:
    match = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
    return float(match.group(1)) if match else None


def _rank3_ends_on_node1(base: Path, inject: str, logged: str) -> tuple[dict, float]:
    """Run two nodes with `inject` ending rank 3 (node 1): the leader's first rank-gone or hang finding,
    and the time rank 3 logged its end (`logged`: a regex whose group 1 is that time)."""
    with nodes(base) as (leader, node1):
        with torchrun_nodes(base, [leader, node1], 200, "--inject", inject):
            (finding,) = wait_until(
                lambda: [d for d in leader.records("decision") if d["rule"] in ("rank-gone", "hang")][:1],
                "a finding about rank 3",
                120,
            )
            ended = wait_until(lambda: _logged_time(base / "node1-trainer.out", logged), "rank 3's logged end", 30)
    return finding, ended


def test_an_exception_on_another_node_is_named_crashed_with_its_error(tmp_path):
    """Issue 24 item 3 across nodes: rank 3 (node 1) dies of an exception; the leader's rank-gone names it,
    `crashed` with its exception, within 5 s (the ranks that lost it are echoes, not the cause). At step 2,
    in the run's first second: CI (8ffa4a6) found rank 1's echo at the leader before node 1 had forwarded
    any report, and no culprit named; node 1 now forwards a rank's first report and its end at once."""
    gone, raised = _rank3_ends_on_node1(
        tmp_path, "raise:rank=3,step=2", r"injected exception at step \d+, raising at ([0-9.]+)"
    )
    culprit = gone["evidence"]["culprit"]
    assert gone["rule"] == "rank-gone" and culprit is not None, gone["reason"]
    assert (culprit["rank"], culprit["state"]) == (3, "crashed"), gone["reason"]
    assert culprit["error"] == "InjectedError: injected exception on rank 3 at step 2"
    assert gone["time"] - raised < 5, gone["time"] - raised


def test_a_rank_killed_on_another_node_is_named_gone_beside_its_peers_echoes(tmp_path):
    """Rank 3 (node 1) exits hard, with no word: its peers crash of the lost peer (echoes) and the
    launchers end the rest. Node 1's sidecar lives on and reports rank 3 gone, so the leader, which
    waits while a node has sent nothing since the first echo, names rank 3 within 5 s, not an echo and
    not after ECHO_WAIT_SECONDS. Torchrun ends rank 2 (its TP peer) tens of ms after, also without a
    word: the exits node 1 saw tell which ended first, not the ranks' last samples."""
    gone, crashed = _rank3_ends_on_node1(
        tmp_path, "crash:rank=3,step=6", r"injected crash at step \d+, exiting at ([0-9.]+)"
    )
    culprit = gone["evidence"]["culprit"]
    assert gone["rule"] == "rank-gone" and culprit is not None, gone
    assert (culprit["rank"], culprit["state"]) == (3, "gone"), gone
    assert culprit["ended"] is not None or not hasattr(os, "pidfd_open"), gone  # node 1 saw it end
    assert gone["time"] - crashed < 5, gone["time"] - crashed


def test_a_rollback_replaying_3x_the_hang_bound_across_nodes_completes(tmp_path):
    """Issue 24 item 1 across nodes: the leader with a 3 s hang bound and --hang-abort; an operator rollback
    replays over 9 s on both nodes. The run completes on both, and no hang (or rank-gone) is recorded."""
    steps, target = 72, 8  # 64 steps after the rollback: >= 9.6 s at the fastest step here (0.15 s)
    with nodes(tmp_path, leader_args=("--hang-min-seconds", "3", "--hang-abort")) as (leader, node1):
        with torchrun_nodes(
            tmp_path, [leader, node1], steps, "--checkpoint-every", "8", "--keep-checkpoints", "0"
        ) as procs:
            wait_until(lambda: (leader.status().get("last_step") or 0) >= 48, "step 48 at the leader", 150)
            leader.control("rollback", to_step=target, reason="two-node replay")
            t0 = time.monotonic()
            finish(tmp_path, procs)
            replay_s = time.monotonic() - t0
            hang = one_client.get(f"{leader.control_url}/v1/hang", headers=HEADERS, timeout=10).json()
        findings = [d for d in leader.records("decision") if d["rule"] in ("hang", "rank-gone")]
    assert not findings, [d["reason"] for d in findings]
    assert hang["bound_seconds"] <= 4 and replay_s > 3 * hang["bound_seconds"], (replay_s, hang["bound_seconds"])
    summary = json.loads((tmp_path / "summary0.json").read_text())
    (applied,) = summary["directives_applied"]
    assert applied["action"] == "rollback" and applied["to_step"] == target and summary["steps_completed"] == steps


def test_one_slow_rank_on_another_node_is_named(tmp_path):
    """Issue 24 item 7 across nodes: rank 3 (node 1) computes 20 ms more per microbatch; node 1 forwards its
    ranks' figures (own compute included) and the leader's straggler finding names rank 3, not stage 1 alone.
    serial_tp: the synthetic sleep after the TP all-reduces, as real layers' compute is. With the sleep to a
    deadline that includes them, rank 0's compute shrank by its waits for rank 1 (whose gradients come from
    the straggler) and rank 1 stood out from it: 3 of 6 runs named rank 1 on 9b25a72."""
    compute = synthetic(10, 20, serial_tp=True)
    with nodes(tmp_path) as (leader, node1):
        with torchrun_nodes(
            tmp_path, [leader, node1], 40, "--inject", "straggler:rank=3,ms=20", compute=compute
        ) as procs:
            finish(tmp_path, procs)
        found = [d["evidence"].get("culprit") for d in leader.records("decision") if d["rule"] == "straggler"]
    # Its stage slow with rank 3 named in it ({"ranks": [2, 3], "rank": 3}), or rank 3 alone against its stage
    # peer step by step ({"ranks": [3], "rank": 3}: issue 44), as the evaluation's window has it.
    assert found and all(
        (c["cause"], c["stage"], c.get("rank")) == ("slow-compute", 1, 3) and c["ranks"] in ([2, 3], [3]) for c in found
    ), found


def worker_pids(launcher_pid: int) -> list[int]:
    """The pids of the ranks a torchrun launcher started: its children (from /proc) that have a LOCAL_RANK."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/environ", "rb") as f:
                    is_rank = b"\0LOCAL_RANK=" in b"\0" + f.read()
                if parent == launcher_pid and is_rank:
                    found.append(int(entry))
    return found


@contextlib.contextmanager
def stopped(pids: list[int]):
    """SIGSTOP the processes for the block (they send nothing: no ingest, so nothing is delivered)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.3)  # a post sent just before the stop is answered before the directive exists
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_cancel_raced_against_delivery_across_nodes_is_always_true(tmp_path):
    """Issue 24 item 2 across nodes, while both nodes' ranks run. Three kinds of pause, each cancelled:
    - while the leader's ranks are stopped (SIGSTOP: no ingest reaches the leader): the cancel answers 200
      and no rank ever applies the pause;
    - once the leader says it was delivered: 409 (404 once handled), and every rank applies it (then it is
      resumed);
    - after a random lag (the race itself): 200 only when no rank applied the pause; otherwise 409 (or 404
      once handled) and the pause was applied by every rank.
    CI's first version raced only, and on a loaded machine every pause was delivered first (all 409)."""
    import random

    def outcome_of(did):
        return next(
            (
                r
                for r in leader.records()
                if r.get("type") not in ("decision", "delivered") and r.get("directive_id") == did
            ),
            None,
        )

    def delivered(did):
        return any(d["id"] == did and d["state"] == "delivered" for d in leader.status()["directives"])

    def cancel(did):
        return one_client.post(
            f"{leader.control_url}/v1/directives/{did}/cancel",
            json={"requested_by": "race"},
            headers=HEADERS,
            timeout=10,
        ).status_code

    answers = []  # (kind, directive id, status)
    with nodes(tmp_path) as (leader, node1):
        with torchrun_nodes(tmp_path, [leader, node1], 2000) as procs:
            wait_until(lambda: (leader.status().get("last_step") or 0) >= 4, "step 4 at the leader", 120)
            leader_ranks = worker_pids(procs[0].pid)
            assert len(leader_ranks) == 2, leader_ranks
            for i in range(9):
                kind = ("stopped", "delivered", "raced")[i % 3]
                if kind == "stopped":
                    with stopped(leader_ranks):
                        did = leader.control("pause", reason=f"race {i}")["directive_id"]
                        status = cancel(did)
                else:
                    did = leader.control("pause", reason=f"race {i}")["directive_id"]
                    if kind == "delivered":
                        wait_until(lambda d=did: delivered(d), f"pause {did} delivered", 30)
                    else:
                        time.sleep(random.Random(i).uniform(0.0, 0.4))
                    status = cancel(did)
                answers.append((kind, did, status))
                if status != 200:
                    wait_until(lambda d=did: outcome_of(d), f"pause {did} applied", 30)
                    resume = leader.control("resume", reason=f"race {i}")["directive_id"]
                    wait_until(lambda d=resume: outcome_of(d), f"resume {resume} applied", 30)
            time.sleep(1.0)  # a cancelled pause that was delivered anyway would show its outcome by now
            records = leader.records()
    for kind, did, status in answers:
        outcomes = [
            r for r in records if r.get("type") not in ("decision", "delivered") and r.get("directive_id") == did
        ]
        if kind == "stopped":
            assert status == 200, (kind, did, status)
        elif kind == "delivered":  # 409; 404 when every rank had applied it before the cancel came
            assert status in (404, 409), (kind, did, status)
        if status == 200:
            assert [o["type"] for o in outcomes] == ["cancelled"], (did, outcomes)
        else:
            assert status in (404, 409) and [o["type"] for o in outcomes] == ["applied"], (did, status, outcomes)
            assert outcomes[0]["rank_count"] == 4, outcomes
