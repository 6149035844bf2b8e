"""Two "nodes" on loopback, one run, one decision (issue 8), and cross-node matching (issue 10).

Each node is its own `torchrun --nnodes 2 --node-rank K --nproc-per-node 2` (static rendezvous)
whose ranks ship to that node's own sidecar, as the Helm chart deploys it. Node 0's sidecar
receives rank 0's summaries, so it is the leader: it alone decides, and it learns every rank's
outcome of a directive from rank 0 alone (counted in the step-boundary all-reduce). Node 1's
sidecar has --leader-url: it forwards its digest and the halves of the p2p instances between
the stages (stage 0 on node 0, stage 1 on node 1: every PP send/recv crosses nodes), which the
leader matches and splits into wait and transfer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_util import (
    ROOT,
    TORCHRUN,
    kill_group,
    launch_nodes,
    read_jsonl,
    rendezvous_port_taken_once,
    synthetic,
    wait_nodes,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

from tests import one_client
from tests.sidecar_process import free_port, sidecar_command, stop, wait_healthy

pytestmark = pytest.mark.integration
TOKEN = "multinode-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
PROMTOOL = shutil.which("promtool")
RUN_TIMEOUT_S = 240


class Node:
    """One node's sidecar on fixed ports, so a restarted one is found at the same address."""

    def __init__(self, base: Path, name: str, *args: str):
        self.args = args
        self.state_dir = base / f"{name}-state"
        self.metrics_port, self.control_port = free_port(), free_port()
        self.log = base / f"{name}-sidecar.log"
        self.proc: subprocess.Popen | None = None

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self) -> Node:
        env = dict(os.environ, PARWATCH_TOKEN=TOKEN)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                sidecar_command(
                    "--state-dir",
                    str(self.state_dir),
                    "--metrics-listen",
                    f"127.0.0.1:{self.metrics_port}",
                    "--control-listen",
                    f"127.0.0.1:{self.control_port}",
                    *self.args,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        wait_healthy(f"{self.control_url}/healthz", self.proc, 60)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def status(self) -> dict:
        r = one_client.get(f"{self.control_url}/v1/status", headers=HEADERS, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def control(self, action: str, **body) -> dict:
        r = one_client.post(
            f"{self.control_url}/v1/control", json={"action": action, **body}, headers=HEADERS, timeout=10
        )
        assert r.status_code == 200, r.text
        return r.json()

    def records(self, kind: str | None = None) -> list[dict]:
        rows = read_jsonl(self.state_dir / "decisions.jsonl")
        return [r for r in rows if kind is None or r.get("type") == kind]

    def metrics(self) -> str:
        r = one_client.get(f"{self.metrics_url}/metrics", timeout=10)
        assert r.status_code == 200
        return r.text

    def samples(self, name: str) -> dict:
        """{(op, group[, reason]) or (rank,): value} of one sample name on this sidecar's /metrics."""
        out = {}
        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == name:
                    labels = s.labels
                    key = (
                        (labels["rank"],)
                        if "rank" in labels
                        else tuple(labels[k] for k in ("op", "group", "reason", "rule") if k in labels)
                    )
                    out[key] = s.value
        return out


@contextlib.contextmanager
def two_nodes(base: Path):
    leader = Node(base, "node0")
    nodes = [leader, Node(base, "node1", "--leader-url", leader.control_url)]
    try:
        yield [n.start() for n in nodes]
    finally:
        for n in nodes:
            n.stop()


@contextlib.contextmanager
def torchrun_nodes(
    base: Path,
    nodes: list[Node],
    steps: int,
    *extra: str,
    run_id: str = "",
    compute: tuple[str, ...] = synthetic(10, 20),
):
    """Both nodes' torchrun launchers (TP2 x PP2: node 0 holds stage 0, node 1 stage 1, one block each: 16 TP
    all-reduces a step where the trainer's default 4 layers make 32, 37% less CPU a step on 2 cores, the step as
    long); `compute`: the synthetic compute's arguments (e2e_util.synthetic)."""
    env = dict(os.environ, PARWATCH_TOKEN=TOKEN, TRAINER_THREADS="1")
    if run_id:
        env["PARWATCH_RUN_ID"] = run_id
    args = [
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
            "--layers",
            "2",
            "--steps",
            str(steps),
            *compute,
            "--pause-poll-s",
            "0.2",
            "--parwatch-endpoint",
            node.control_url,
            "--parwatch-log",
            str(base / f"log{k}"),
            "--checkpoint-dir",
            str(base / "ckpt"),
            "--checkpoint-every",
            "4",
            "--timeout-s",
            "120",
            "--summary-json",
            str(base / f"summary{k}.json"),
            *extra,
        ]
        for k, node in enumerate(nodes)
    ]
    procs = launch_nodes(_outs(base, len(nodes)), args, [env] * len(nodes))
    try:
        yield procs
    finally:
        for p in procs:
            kill_group(p)


def _outs(base: Path, n: int) -> list[Path]:
    return [base / f"node{k}-trainer.out" for k in range(n)]


def finish(base: Path, procs) -> None:
    wait_nodes(procs, _outs(base, len(procs)), RUN_TIMEOUT_S)


def promtool_clean(text: str) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0 and not problems, problems


KILL_HELD_S = 2.5
"""Node 1's sidecar forwards once a second: summaries it received this long before its SIGKILL may
have died with it (a tick, plus the ranks' post delay and a loaded machine's slack)."""


def cross_node_instances(base: Path, killed_at: float) -> tuple[int, int]:
    """(p2p instances the ranks recorded, at most how many lost): every PP send/recv crosses nodes here.
    Lost: summaries the ranks dropped (node 1's while its sidecar was away) and node 1's summaries of
    the KILL_HELD_S before its sidecar was killed, times the records one holds."""
    keys, per_summary, dropped, held = set(), 0, {}, 0
    for k in (0, 1):
        for s in read_jsonl(base / f"log{k}" / "summaries.jsonl"):
            p2p = [r for r in (s.get("instances") or {}).get("records", ()) if r[3] >= 0]
            for op, _group, seq, peer, *_ in p2p:
                keys.add((s["rank"], peer, seq) if op == "send" else (peer, s["rank"], seq))
            per_summary = max(per_summary, len(p2p))
            dropped[s["rank"]] = max(dropped.get(s["rank"], 0), s["dropped_total"])
            held += k == 1 and killed_at - KILL_HELD_S <= s["time"] <= killed_at
    return len(keys), per_summary * (sum(dropped.values()) + held)


def rank_series(text: str, name: str) -> set[str]:
    return {
        line.split('rank="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith(name + "{") and 'rank="' in line
    }


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python")
def test_two_nodes_roll_back_pause_resume_and_survive_a_sidecar_crash(tmp_path):
    with two_nodes(tmp_path) as (leader, node1):
        with torchrun_nodes(
            tmp_path, [leader, node1], 90, "--pre-step-check", "off", "--inject", "nan:step=10"
        ) as procs:
            # (a) the NaN at step 10 is rolled back on all four ranks, decided by the leader alone
            applied = wait_until(lambda: leader.records("applied"), "the rollback's outcome at the leader", 150)
            (decision,) = [r for r in leader.records("decision") if r["action"] == "rollback"]
            assert decision["rule"] == "nonfinite-loss" and decision["checkpoint"] == 8
            assert applied[0]["directive_id"] == decision["directive_id"]
            assert (applied[0]["ranks"], applied[0]["rank_count"], applied[0]["loaded_step"]) == ("0-3", 4, 8)
            assert leader.status()["pending_directive"] is None  # nothing outstanding
            assert node1.records() == []  # the other node's sidecar decides nothing
            promtool_clean(leader.metrics())
            promtool_clean(node1.metrics())
            assert rank_series(node1.metrics(), "parwatch_rank_up") == {"2", "3"}

            # (b) an operator pause through the leader holds all four ranks; resume releases them
            pause = leader.control("pause", reason="multinode test")
            wait_until(lambda: leader.status()["paused"], "the pause applied on every rank", 60)
            # Its outcome record: the status turns paused as the engine takes the outcome, and the record
            # reaches decisions.jsonl at the next write (CI on 35032b4 read the records before it was there).
            held = wait_until(
                lambda: [r for r in leader.records("applied") if r["directive_id"] == pause["directive_id"]],
                "the pause's outcome record",
                10,
            )
            assert held[0]["rank_count"] == 4
            # The step every rank applied the pause at (its outcome record), against the steps of the timeline
            # after the rollback: the first one ran to 12 before it was rolled back to 8. (CI on 02e6495: with
            # faster polling the pause came at 10 of the second, and every step of both was compared.)
            step_paused = held[0]["step"]
            time.sleep(2.0)
            for k in (0, 1):
                summaries = read_jsonl(tmp_path / f"log{k}" / "summaries.jsonl")
                steps = [s["step"] for s in summaries if s["timeline"] == max(s["timeline"] for s in summaries)]
                assert max(steps) <= step_paused + 1, f"node {k} trained on while paused"
            leader.control("resume")
            wait_until(lambda: not leader.status()["paused"], "the resume applied", 60)

            # (c) node 1's sidecar killed mid-run: training goes on; restarted, its metrics come back
            killed_at = time.time()
            node1.kill()
            before = max(s["step"] for s in read_jsonl(tmp_path / "log0" / "summaries.jsonl"))
            wait_until(
                lambda: max(s["step"] for s in read_jsonl(tmp_path / "log0" / "summaries.jsonl")) >= before + 3,
                "training to go on without node 1's sidecar",
                60,
            )
            node1.start()
            wait_until(
                lambda: rank_series(node1.metrics(), "parwatch_rank_up") == {"2", "3"},
                "node 1's ranks on its restarted sidecar",
                60,
            )
            promtool_clean(node1.metrics())
            finish(tmp_path, procs)
        promtool_clean(leader.metrics())
        promtool_clean(node1.metrics())
        assert leader.status()["pending_directive"] is None
        assert node1.records() == []

        # (f) the PP sends and receives cross nodes: node 1 forwarded its halves, the leader matched them.
        # Only those are missing whose node-1 record was in a summary dropped while its sidecar was down
        # in (c) (the ranks' JSONL has every summary; dropped_total counts the lost posts), or still held
        # by node 1's sidecar when it was killed (it forwards once a second).
        started = time.monotonic()
        total, lost_at_most = cross_node_instances(tmp_path, killed_at)
        pp = ("send", "pp")

        def matched():
            return leader.samples("parwatch_collective_transfer_seconds_count").get(pp, 0)

        with contextlib.suppress(AssertionError):  # the last second's forward; the figures say what came
            wait_until(lambda: matched() >= total - lost_at_most, "the cross-node sends matched at the leader", 15)
        figures = {
            "instances": total,
            "in dropped summaries": lost_at_most,
            "matched": matched(),
            "unmatched at the leader": {
                k: v for k, v in leader.samples("parwatch_collective_unmatched_total").items() if k[:2] == pp
            },
            "node 1 unmatched": node1.samples("parwatch_collective_unmatched_total"),
            "transfer_s": leader.samples("parwatch_collective_transfer_seconds_sum").get(pp),
            "wait_s": leader.samples("parwatch_collective_wait_seconds_total"),
            "busbw": leader.samples("parwatch_collective_busbw_bytes_per_second").get(pp),
            "straggler_s": leader.samples("parwatch_rank_straggler_seconds_total"),
        }
        print(f"cross-node figures ({time.monotonic() - started:.1f} s to gather):", figures)
        assert total >= 16 * 90, figures  # 16 a step: m=4 each way, 2 stage pairs
        assert total - lost_at_most <= figures["matched"] <= total, figures
        assert figures["matched"] >= 16 * 10, figures  # at least the steps before (c) (how many after, load decides)
        assert sum(figures["unmatched at the leader"].values()) + figures["matched"] <= total, figures  # once each
        assert not [k for k in figures["node 1 unmatched"] if k[2] == "remote"], figures  # all forwarded
        waits = figures["wait_s"]
        assert waits.get(("recv", "pp"), 0) > 0 and ("send", "pp") in waits, figures
        assert figures["transfer_s"] > 0 and figures["busbw"] > 0, figures
        assert {("0",), ("1",), ("2",), ("3",)} <= set(figures["straggler_s"]), figures
        # node 1 matches only its own TP all-reduces: no PP instance is finished twice
        assert pp not in node1.samples("parwatch_collective_transfer_seconds_count")
        assert ("all_reduce", "tp") in node1.samples("parwatch_collective_transfer_seconds_count")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python")
def test_a_corrupt_newest_checkpoint_is_skipped_and_a_second_run_starts_clean(tmp_path):
    with two_nodes(tmp_path) as (leader, node1):
        with torchrun_nodes(
            tmp_path, [leader, node1], 16, "--pre-step-check", "off", "--inject", "nan:step=11", run_id="run-one"
        ) as procs:
            # (d) corrupt checkpoint 8 (one shard of node 1) once it is complete, before the NaN
            manifest = tmp_path / "ckpt" / "step_00000008" / "manifest.json"
            wait_until(manifest.exists, "checkpoint 8", 150, interval=0.02)
            shard = tmp_path / "ckpt" / "step_00000008" / "rank_00003.pt"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            finish(tmp_path, procs)
        (decision,) = [r for r in leader.records("decision") if r["action"] == "rollback"]
        assert decision["checkpoint"] == 8
        (outcome,) = [
            r
            for r in leader.records()
            if r.get("directive_id") == decision["directive_id"] and r["type"] not in ("decision", "delivered")
        ]
        assert (outcome["type"], outcome["requested_step"], outcome["loaded_step"]) == ("substituted", 8, 4)
        assert outcome["rank_count"] == 4
        assert leader.status()["pending_directive"] is None

        # (e) a second run on the same leader state dir starts with nothing pending, the first archived
        leader.control("pause", reason="left over from run one")  # outstanding when run one is over
        assert leader.status()["pending_directive"]["run_id"] == "run-one"
        shutil.rmtree(tmp_path / "ckpt")
        with torchrun_nodes(tmp_path, [leader, node1], 3, run_id="run-two") as procs:
            finish(tmp_path, procs)
        status = leader.status()
        assert status["run"]["run_id"] == "run-two" and status["pending_directive"] is None
        assert not status["paused"] and leader.records("decision") == []
        archived = read_jsonl(leader.state_dir / "runs" / "run-one" / "decisions.jsonl")
        assert {r["type"] for r in archived} >= {"decision", "substituted"}


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python")
@pytest.mark.slow  # test_fault_campaign.py's two nodes launched again after EADDRINUSE go through launch_nodes
def test_nodes_whose_rendezvous_port_was_taken_are_launched_again_on_another(tmp_path, monkeypatch):
    """A port free a moment ago can be taken before node 0's torchrun binds it (EADDRINUSE: the fault
    campaign's torchrun in CI on d94243b). launch_nodes launches the nodes again on another port."""
    outs = [tmp_path / "node0.out", tmp_path / "node1.out"]
    with rendezvous_port_taken_once(monkeypatch) as picked:
        args = ["--pp", "4", "--steps", "2", *synthetic(1, 2), "--parwatch", "off", "--timeout-s", "60"]
        procs = launch_nodes(outs, [args] * 2, [dict(os.environ, TRAINER_THREADS="1")] * 2)
        try:
            assert len(picked) == 2 and "already in use" in outs[0].read_text()  # the first launch's, kept
            wait_nodes(procs, outs, timeout=120)
        finally:
            for proc in procs:
                kill_group(proc)
