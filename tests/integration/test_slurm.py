"""examples/slurm/parwatch.sbatch against a real Slurm: slurmctld + slurmd from Debian's slurm-wlm 22.05,
two nodes (two slurmd on this host, 2 CPUs each), started by scripts/slurm_local.sh for this module (all
state in a temp dir) and stopped after it, every job of it cancelled first.

- A 2-task job on two nodes (srun, a task per rank) runs watched: node 1's sidecar forwards to the leader
  on node 0, whose /metrics shows both ranks up; the NaN is rolled back (nonfinite-loss, applied by both
  ranks); the job completes.
- A hang under PARWATCH_ON_HANG=requeue (torchrun per node): the leader decides the hang, requeues the job
  with scontrol once, the job restarts under the same id and run id, resumes from its newest verified
  checkpoint and completes; Slurm counts Restarts=1 and the goodput ledger counts the gap as down.
- scontrol refusing a requeue is recorded as an alert, never lost.

Every job has a time limit (-t) and every wait a deadline; the sidecars' ports are picked free.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.rules import default_rules
from parwatch.ports import free_port
from parwatch.report.loader import load_run
from parwatch.sidecar.requeue import SlurmJob, SlurmRequeue
from parwatch.vocabulary import Action, RuleAction, TimeCategory
from tests import one_client
from tests.deadline import DeadlineExceeded
from tests.integration.e2e_util import (
    SMALL_MODEL,
    applied_records,
    decision_records,
    is_finite_loss,
    read_jsonl,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SLURM_LOCAL = ROOT / "scripts" / "slurm_local.sh"
EXAMPLE = ROOT / "examples" / "slurm" / "parwatch.sbatch"
JOB_WAIT_S = 150.0
"""A job's whole life, a requeue and its restart included (its -t limit is 3 minutes)."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
REQUEUE_DELAY_S = 6.0
"""slurm_local.sh's cred_expire=5: a requeued job may start again 5 + 1 s after the requeue."""
TRAIN = (*SMALL_MODEL, "--pp", "2", "--microbatches", "2")
RANK_UP = re.compile(r'^parwatch_rank_up\{(?:[^}]*,)?rank="(\d+)"[^}]*\} (\S+)$')


@dataclass
class Cluster:
    dir: Path
    env: dict

    def run(self, *cmd: str, timeout: float = 30.0) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}"
        return done.stdout

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (Restarts, JobState, StartTime, ...)."""
        fields = {}
        for item in self.run("scontrol", "show", "job", "-o", job_id).split():
            key, eq, value = item.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait_ended(self, job: Job, timeout: float = JOB_WAIT_S) -> dict:
        """`scontrol show job` once the job ended; on timeout the error holds its state and output."""
        try:
            return wait_until(
                lambda: (j := self.job(job.id))["JobState"] in ENDED and j, f"job {job.id} to end", timeout, 0.25
            )
        except DeadlineExceeded as err:  # never re-run as a slow figure (tests/timing_rerun.py)
            output = job.output.read_text() if job.output.exists() else "(no output file)"
            raise DeadlineExceeded(f"{err}; {self.job(job.id).get('JobState')}; output:\n{output[-4000:]}") from None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        pytest.skip("Slurm is not installed: scripts/setup.sh test installs it (scripts/slurm_local.sh install)")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(  # two nodes (two slurmd on this host), 2 CPUs each
        ["bash", str(SLURM_LOCAL), "start", str(state), "2"], capture_output=True, text=True, timeout=60, check=False
    )
    if started.returncode != 0:
        subprocess.run(["bash", str(SLURM_LOCAL), "stop", str(state)], timeout=60, check=False)
        pytest.skip(f"the local Slurm daemons did not start: {started.stderr.strip()}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHONPATH": str(ROOT)}
    cluster = Cluster(state, env)
    try:
        yield cluster
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
        for job_id in jobs.stdout.split():
            subprocess.run(["scancel", job_id], env=env, timeout=30, check=False)
        deadline = time.monotonic() + 30  # the jobs' processes end before the daemons that would kill them
        while (
            time.monotonic() < deadline
            and subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout.strip()
        ):
            time.sleep(0.25)
        subprocess.run(["bash", str(SLURM_LOCAL), "stop", str(state)], timeout=60, check=False)


@dataclass
class Job:
    id: str
    output: Path
    run_dir: Path
    state_dir: Path
    metrics_port: int

    def metrics_url(self, node: int = 0) -> str:
        return f"http://127.0.0.1:{self.metrics_port + node}/metrics"  # PARWATCH_PORT_STRIDE=1


def _four_free_ports() -> int:
    """A base port with base..base+3 free: each node's metrics and control port (stride 1, two nodes)."""
    for _ in range(50):
        base = free_port()
        if base + 3 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + 4):
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return base
    raise AssertionError("no four consecutive free ports")


def submit(cluster: Cluster, tmp: Path, script: Path, *train_args: str, nodes: int = 1, **env: str) -> Job:
    base = _four_free_ports()
    job_env = {
        **cluster.env,
        "PARWATCH_RUN_ROOT": str(tmp / "runs"),
        "PARWATCH_STATE_ROOT": str(tmp / "state"),
        "PARWATCH_METRICS_PORT": str(base),  # node k: metrics base + k, control base + 2 + k
        "PARWATCH_CONTROL_PORT": str(base + 2),
        "PARWATCH_PORT_STRIDE": "1",  # the two nodes are two slurmd on this one host
        "PARWATCH_METRICS_HOST": "127.0.0.1",
        "PARWATCH_CHECKPOINT_EVERY": "2",
        **env,
    }
    out = tmp / "job-%j.out"
    per_node = 2 // nodes
    cmd = [
        "sbatch",
        "--parsable",
        f"-N{nodes}",
        f"--ntasks-per-node={per_node}",
        "-t",
        "3",
        "-o",
        str(out),
        "-D",
        str(tmp),
    ]
    done = subprocess.run(
        [*cmd, str(script), *train_args], env=job_env, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    return Job(
        job_id,
        Path(str(out).replace("%j", job_id)),
        tmp / "runs" / f"slurm-{job_id}",
        tmp / "state" / f"parwatch-{job_id}" / "node0",
        base,
    )


def _ranks_up(metrics_url: str) -> set[str]:
    """The ranks whose parwatch_rank_up is 1 on the sidecar's /metrics now (none while it does not answer)."""
    try:
        text = one_client.get(metrics_url, timeout=2).text
    except httpx.HTTPError:
        return set()
    up = set()
    for line in text.splitlines():
        found = RANK_UP.match(line)
        if found and float(found.group(2)) == 1.0:
            up.add(found.group(1))
    return up


def _while_running(cluster: Cluster, job: Job, predicate):
    """predicate() for wait_until, failing at once (with the job's output) when the job ended first."""

    def check():
        value = predicate()
        if not value and cluster.job(job.id)["JobState"] in ENDED:
            raise AssertionError(f"job {job.id} ended first:\n{job.output.read_text()}")
        return value

    return check


def test_a_two_node_job_runs_watched_and_a_nan_is_rolled_back(slurm, tmp_path):
    """Two nodes, a rank each (srun, a task per rank): node 1's sidecar forwards to the leader on node 0."""
    # 100 ms a step (rank 0 fetches 2 microbatches): 2 s or more of steps to read /metrics in (the leader hears
    # of rank 1 once a second)
    slow = ("--inject", "slow-data:rank=0,ms=50")
    nan = ("--pre-step-check", "off", "--inject", "nan:step=5")  # the NaN reaches the weights: the rules' rollback
    job = submit(slurm, tmp_path, EXAMPLE, *TRAIN, "--steps", "20", *nan, *slow, nodes=2)
    wait_until(  # while it runs: the leader exports both ranks up (rank 1 from node 1's digest), node 1 its own
        _while_running(
            slurm, job, lambda: _ranks_up(job.metrics_url(0)) >= {"0", "1"} and "1" in _ranks_up(job.metrics_url(1))
        ),
        "both ranks up on the leader's /metrics, rank 1 on node 1's",
        JOB_WAIT_S,
        0.25,
    )
    ended = slurm.wait_ended(job)
    output = job.output.read_text()
    assert (ended["JobState"], ended["ExitCode"], ended["Restarts"]) == ("COMPLETED", "0:0", "0"), output
    assert "the trainer exited with 0" in output and "the leader's sidecar did not start" not in output, output
    [rollback] = [d for d in decision_records(job.state_dir) if d["rule"] == "nonfinite-loss"]
    assert rollback["action"] == Action.ROLLBACK and rollback["run_id"] == f"slurm-{job.id}"
    [applied] = applied_records(job.state_dir)
    assert applied["directive_id"] == rollback["directive_id"] and applied["ranks"] == "0-1"
    summaries = read_jsonl(job.run_dir / "log" / "summaries.jsonl")
    assert {s["run_id"] for s in summaries} == {f"slurm-{job.id}"} and {s["rank"] for s in summaries} == {0, 1}
    last = [s for s in summaries if s["rank"] == 1 and s["step"] == 20][-1]  # the last stage reports the loss
    assert is_finite_loss(last["loss"]), last["loss"]  # trained on past the NaN, from the checkpoint before it


def test_a_hang_requeues_the_job_once_and_it_completes(slurm, tmp_path):
    # The hang is injected in the job's first run only: the requeued one must run through.
    wrapper = tmp_path / "hang-once.sbatch"  # with the example's #SBATCH lines (--requeue, --open-mode=append)
    header = [line for line in EXAMPLE.read_text().splitlines() if line.startswith("#SBATCH")]
    wrapper.write_text(
        "#!/bin/bash\n" + "\n".join(header) + "\n"
        'if [ -z "${SLURM_RESTART_COUNT:-}" ]; then set -- "$@" --inject hang:rank=1,step=5,where=compute; fi\n'
        f'exec bash {EXAMPLE} "$@"\n'
    )
    job = submit(
        slurm,
        tmp_path,
        wrapper,
        *TRAIN,
        "--steps",
        "8",
        PARWATCH_LAUNCHER="torchrun",
        PARWATCH_ON_HANG="requeue",
        PARWATCH_SIDECAR_ARGS="--hang-min-seconds 2",
    )
    ended = slurm.wait_ended(job)
    output = job.output.read_text()
    assert (ended["JobState"], ended["ExitCode"], ended["Restarts"]) == ("COMPLETED", "0:0", "1"), output
    assert "attempt 1 " in output and "attempt 2 " in output and "DUE TO JOB REQUEUE" in output, output
    [hang] = [d for d in decision_records(job.state_dir) if d["rule"] == "hang"]
    assert hang["action"] == RuleAction.REQUEUE and hang["enforced"], hang
    assert hang["evidence"]["culprit"]["rank"] == 1
    assert hang["evidence"]["requeue"] == {"job_id": job.id, "restarts": 0, "max_requeues": 1}
    # The same run id across both runs; the second resumed from a checkpoint before the hang and finished.
    summaries = read_jsonl(job.run_dir / "log" / "summaries.jsonl")
    assert {s["run_id"] for s in summaries} == {f"slurm-{job.id}"}
    starts = sorted({s["process_start_time"] for s in summaries if s["rank"] == 0})
    assert len(starts) == 2, starts
    resumed = [s["step"] for s in summaries if s["rank"] == 0 and s["process_start_time"] == starts[1]]
    assert 1 < min(resumed) <= 5 and max(resumed) == 8, resumed
    # The gap is down: at least from the requeue decision to the second run's start (Slurm's StartTime, 1 s).
    restarted = time.mktime(time.strptime(ended["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    assert restarted - hang["time"] >= REQUEUE_DELAY_S - 1
    ledgers = load_run(job.run_dir / "log").ledgers
    for rank in (0, 1):
        assert ledgers[rank][TimeCategory.DOWN] >= restarted - hang["time"] - 1.0, (rank, ledgers[rank])


def test_a_requeue_scontrol_refuses_is_an_alert(slurm, tmp_path, monkeypatch):
    """A job id the controller does not know: scontrol fails, and the engine records the failure as an alert."""
    import asyncio

    engine = GuardrailEngine(default_rules(), tmp_path / "state")
    requeue = SlurmRequeue(SlurmJob("999999"), max_requeues=1)

    async def persist():  # the engine here writes as it decides (no deferred writes): nothing owed
        return None

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    asyncio.run(requeue.carry_out({"id": 7, "rule": "hang", "step": 4}, persist, engine.record_finding))
    [alert] = decision_records(tmp_path / "state")
    assert (alert["rule"], alert["action"], alert["step"]) == ("hang", RuleAction.ALERT, 4)
    assert "requeue (decision 7) failed: scontrol requeue 999999" in alert["reason"], alert
    assert "Invalid job id" in alert["reason"], alert
    assert alert["evidence"]["requeue_decision"] == 7 and requeue.requested_by is None
