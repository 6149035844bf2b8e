"""The requeue action without a cluster: when a hang or a rule may requeue the Slurm job, what the decision
record says when it may not, and the settings that refuse a requeue with nothing to requeue. The real
`scontrol requeue` of a running job is tests/integration/test_slurm.py's."""

from __future__ import annotations

import asyncio

import pytest

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.rules import default_rules, load_rules
from parwatch.rank_layout import RankLayout
from parwatch.sidecar.config import ConfigError, SidecarConfig
from parwatch.sidecar.hang import HangMonitor, HangSettings
from parwatch.sidecar.requeue import SlurmJob, SlurmRequeue, job_from_env
from parwatch.sidecar.service import build_sidecar
from parwatch.trainer.errors import ConfigError as TrainerConfigError
from parwatch.trainer.launch import adopt_slurm_task
from parwatch.vocabulary import RuleAction
from tests.integration.e2e_util import decision_records
from tests.unit.test_hang_analysis import Clock, act

REQUEUE_RULE = """
version: 1
rules:
  - name: rank-lost
    metric: rank_up
    reduce: min
    below: 1
    for_seconds: 30
    action: requeue
"""


def _hang(tmp_path, requeue: SlurmRequeue, enforce_run: str | None = "slurm-42"):
    """A real engine, a hang monitor with --hang-requeue, and a hang of rank 1 past its bound: the records."""
    engine = GuardrailEngine(default_rules(), tmp_path / "state")
    if enforce_run:
        engine.begin_run(enforce_run)
    clock = Clock()
    monitor = HangMonitor(HangSettings(requeue=True), engine, clock, requeue=requeue)
    lay = RankLayout(1, 2, 1)
    for step in range(1, 6):
        clock.t += 1.0
        monitor.observe(act(0, lay, "forward", step=step), lay, clock.t)
    clock.t += 10.5
    rows = {0: act(0, lay, "recv", "recv", "pp", peer=1, step=5), 1: act(1, lay, "forward", step=5, since=1004.0)}
    return monitor.check(rows)


def test_a_hang_decision_requeues_the_job_while_it_may(tmp_path):
    requeue = SlurmRequeue(SlurmJob("42", restarts=0), max_requeues=1)
    [record] = _hang(tmp_path, requeue)
    assert record["rule"] == "hang" and record["action"] == RuleAction.REQUEUE and record["enforced"]
    assert "requeueing Slurm job 42 (restart 1 of at most 1)" in record["reason"]
    assert record["evidence"]["requeue"] == {"job_id": "42", "restarts": 0, "max_requeues": 1}
    assert record["evidence"]["culprit"]["rank"] == 1  # the hang's own evidence is all there
    requeue.take([record])
    assert requeue._due == [record]
    # The record on disk says the same (parwatch decisions reads it).
    [on_disk] = decision_records(tmp_path / "state")
    assert on_disk["action"] == RuleAction.REQUEUE and on_disk["id"] == record["id"]


def test_a_job_restarted_enough_is_not_requeued_again_and_the_hang_says_why(tmp_path):
    requeue = SlurmRequeue(SlurmJob("42", restarts=1), max_requeues=1)
    [record] = _hang(tmp_path, requeue)
    assert record["action"] == RuleAction.ALERT
    assert "not requeued: job 42 was restarted 1 time(s) already" in record["reason"], record["reason"]
    requeue.take([record])
    assert requeue._due == []


def test_one_requeue_per_process():
    requeue = SlurmRequeue(SlurmJob("42"), max_requeues=3)
    assert requeue.verdict()[0] == RuleAction.REQUEUE
    requeue.requested_by = 5
    action, note = requeue.verdict()
    assert action == RuleAction.ALERT and "being requeued already (decision 5)" in note
    assert SlurmRequeue(None).verdict()[0] == RuleAction.ALERT


def test_only_enforced_requeue_decisions_are_carried_out():
    requeue = SlurmRequeue(SlurmJob("42"))
    requeue.take(
        [
            {"type": "decision", "action": RuleAction.REQUEUE, "enforced": False, "id": 1},  # dry run
            {"type": "decision", "action": RuleAction.ALERT, "enforced": True, "id": 2},
            {"type": "applied", "action": RuleAction.REQUEUE, "enforced": True, "id": 3},
            {"type": "decision", "action": RuleAction.REQUEUE, "enforced": True, "id": 4},
        ]
    )
    assert [d["id"] for d in requeue._due] == [4]


def test_a_rule_decision_past_the_budget_is_followed_by_an_alert_saying_why(tmp_path):
    engine = GuardrailEngine(default_rules(), tmp_path / "state")
    requeue = SlurmRequeue(SlurmJob("42", restarts=2), max_requeues=2, scontrol="/nonexistent/scontrol")

    async def persist():
        return None

    asyncio.run(requeue.carry_out({"id": 3, "rule": "rank-lost", "step": 9}, persist, engine.record_finding))
    [alert] = decision_records(tmp_path / "state")
    assert (alert["rule"], alert["action"], alert["step"]) == ("rank-lost", RuleAction.ALERT, 9)
    assert alert["reason"].startswith("requeue (decision 3) not carried out: job 42 was restarted 2 time(s)")


def test_scontrol_ended_with_the_job_it_requeues_is_no_failure(tmp_path):
    """Slurm ends every process of a job it requeues; a late scontrol inside it ends by SIGTERM. The requeue is
    under way: no second record saying it failed (test_slurm in a venv on 5bb7724 had one), and a refusal
    still gets one."""
    engine = GuardrailEngine(default_rules(), tmp_path / "state")
    ended, refused = tmp_path / "scontrol-ended", tmp_path / "scontrol-refused"
    ended.write_text("#!/bin/sh\nkill -TERM $$\n")
    refused.write_text("#!/bin/sh\necho 'Requested operation is presently disabled' >&2\nexit 1\n")
    for script in (ended, refused):
        script.chmod(0o755)

    async def persist():
        return None

    requeue = SlurmRequeue(SlurmJob("42"), scontrol=str(ended))
    asyncio.run(requeue.carry_out({"id": 3, "rule": "hang", "step": 9}, persist, engine.record_finding))
    assert decision_records(tmp_path / "state") == [] and requeue.requested_by == 3
    requeue = SlurmRequeue(SlurmJob("42"), scontrol=str(refused))
    asyncio.run(requeue.carry_out({"id": 4, "rule": "hang", "step": 9}, persist, engine.record_finding))
    [alert] = decision_records(tmp_path / "state")
    assert "requeue (decision 4) failed" in alert["reason"] and "presently disabled" in alert["reason"]


def test_a_decision_that_could_not_be_written_is_never_carried_out(tmp_path):
    """A storage fault never becomes an action: scontrol is not run (a full disk, which cannot be made here)."""
    engine = GuardrailEngine(default_rules(), tmp_path / "state")
    requeue = SlurmRequeue(SlurmJob("42"), scontrol="/nonexistent/scontrol")  # run, it would record a failure

    async def disk_full():
        raise OSError(28, "No space left on device")

    asyncio.run(requeue.carry_out({"id": 3, "rule": "hang", "step": 9}, disk_full, engine.record_finding))
    assert decision_records(tmp_path / "state") == [] and requeue.requested_by is None
    assert requeue.verdict()[0] == RuleAction.REQUEUE  # still allowed: nothing was done


def test_settings_refuse_a_requeue_with_no_job(tmp_path):
    with pytest.raises(ConfigError, match="--hang-requeue requeues the Slurm job"):
        SidecarConfig(hang_requeue=True)
    with pytest.raises(ConfigError, match="--slurm-job-id '42; rm' is not a Slurm job id"):
        SidecarConfig(slurm_job_id="42; rm")
    with pytest.raises(ConfigError, match="--max-requeues must be >= 1"):
        SidecarConfig(slurm_job_id="42", max_requeues=0)
    rules = tmp_path / "rules.yaml"
    rules.write_text(REQUEUE_RULE)
    assert load_rules(rules).rules[0].action == RuleAction.REQUEUE
    with pytest.raises(ConfigError, match=r"rules \['rank-lost'\] have action requeue"):
        build_sidecar(SidecarConfig(rules_path=rules, state_dir=tmp_path / "s1", token="t"))
    built = build_sidecar(SidecarConfig(rules_path=rules, state_dir=tmp_path / "s2", token="t", slurm_job_id="42"))
    assert built.requeue.job == SlurmJob("42", 0)


def test_a_reload_that_adds_a_requeue_rule_outside_slurm_keeps_the_old_rules(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules: []\n")
    sidecar = build_sidecar(SidecarConfig(rules_path=rules, state_dir=tmp_path / "s", token="t"))
    rules.write_text(REQUEUE_RULE)
    assert sidecar.reload_rules() is False and sidecar.counters.rules_reload_failures == 1


def test_the_job_and_its_restarts_come_from_slurms_environment():
    assert job_from_env({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}) == ("42", 2)
    assert job_from_env({}) == (None, 0)


def test_srun_one_task_per_rank_gives_the_trainer_its_rank():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "2",
    }
    assert adopt_slurm_task(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    torchrun = {"RANK": "5", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}  # torchrun's own ranks win
    assert not adopt_slurm_task(torchrun) and torchrun["RANK"] == "5"
    with pytest.raises(TrainerConfigError, match="set MASTER_ADDR and MASTER_PORT in the job script"):
        adopt_slurm_task({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    alone = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}  # `srun -n1 parwatch train`: no peers to meet
    assert adopt_slurm_task(alone) and alone["WORLD_SIZE"] == "1"


def test_a_rule_with_action_requeue_decides_a_requeue_the_sidecar_carries_out(tmp_path):
    from parwatch.guardrails.engine import Observation

    rules = tmp_path / "rules.yaml"
    rules.write_text(REQUEUE_RULE)
    clock = Clock()
    sidecar = build_sidecar(
        SidecarConfig(rules_path=rules, state_dir=tmp_path / "s", token="t", slurm_job_id="42"), clock=clock
    )
    sidecar.engine.begin_run("slurm-42")
    made = []
    for step in range(1, 40):  # rank 1 is down from the start: 30 s later the rule fires
        clock.t += 1.0
        made += sidecar.engine.evaluate(Observation(step, clock.t, {"rank_up": {"rank=0": 1.0, "rank=1": 0.0}}))
    [decision] = made
    assert (decision["rule"], decision["action"], decision["enforced"]) == ("rank-lost", RuleAction.REQUEUE, True)
    assert decision.get("directive_id") is None  # not a directive: no rank is asked to do anything
    sidecar._count(made)
    assert sidecar.requeue._due == [decision]
    assert sidecar.counters.actions[("rank-lost", "requeue")] == 1
