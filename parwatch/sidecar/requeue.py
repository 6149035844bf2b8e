"""Requeue the Slurm job the sidecar runs in: the `requeue` action of a hang decision or of a rule.

A requeue is a decision record like any other (rule, reason, evidence, `parwatch decisions`); the leader
sidecar carries it out itself, once the record is on disk, with `scontrol requeue JOB`. Slurm then ends
every step of the job (ranks and sidecars), puts it back in the queue under the same job id, and runs
its batch script again, which resumes the run from its newest verified checkpoint under the same run id
(examples/slurm/parwatch.sbatch, docs/slurm.md). The goodput ledger counts the gap as `down`.

Bounded twice, so a fault that survives a restart cannot requeue a job forever: at most `max_requeues`
restarts of the job in all (Slurm's own count, $SLURM_RESTART_COUNT, which a requeued job's steps see),
and one requeue per sidecar process. A requeue that may not happen, or that scontrol refuses, is
recorded as an alert that says why; a decision that could not be written is never carried out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from msgspec.structs import asdict

from parwatch.vocabulary import RecordType, RuleAction
from parwatch.wire.findings import Finding, Requeue, RequeueNote

log = logging.getLogger(__name__)

JOB_ID = re.compile(r"^[0-9]{1,20}$")
"""A Slurm job id as scontrol takes it (an array task has its own numeric SLURM_JOB_ID)."""
SCONTROL_TIMEOUT_SECONDS = 30.0
"""scontrol retries an unreachable controller for up to its MessageTimeout (10 s by default)."""
ENDED_WITH_THE_JOB = (-signal.SIGTERM, -signal.SIGKILL)
"""scontrol's exit by SIGTERM or SIGKILL: Slurm ends every process of a job it requeues, the sidecar's
scontrol among them when its answer comes late (a loaded host): the requeue it asked for is under way, not
refused. Recorded as failed, it made a second, false record (test_slurm on 5bb7724 in a venv)."""
MAX_OUTPUT_CHARS = 500


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    restarts: int = 0
    """$SLURM_RESTART_COUNT when the sidecar started: how often Slurm restarted the job before (any cause)."""


def job_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str | None, int]:
    """($SLURM_JOB_ID or None, $SLURM_RESTART_COUNT or 0): srun gives every step of a job both."""
    restarts = environ.get("SLURM_RESTART_COUNT", "")
    return environ.get("SLURM_JOB_ID") or None, int(restarts) if restarts.isdigit() else 0


Record = Callable[[str, str, str, Finding, "int | None"], dict]
"""engine.record_finding: (rule, action, reason, evidence, step) -> the decision record."""


class SlurmRequeue:
    def __init__(
        self,
        job: SlurmJob | None,
        max_requeues: int = 1,
        scontrol: str = "scontrol",
        timeout: float = SCONTROL_TIMEOUT_SECONDS,
    ):
        self.job = job
        self.max_requeues = max_requeues
        self.scontrol = scontrol
        self.timeout = timeout
        self.requested_by: int | None = None
        """The decision whose requeue this process asked for (or is asking for): one per process."""
        self._due: list[dict] = []
        self._wake: asyncio.Event | None = None
        """Set by take(); made by serve() on its own loop (an app's lifespan may run on a new loop)."""

    # -- deciding ---------------------------------------------------------------------------
    def refused(self) -> str | None:
        """Why a requeue may not happen now; None when it may."""
        if self.job is None:
            return "the sidecar does not run in a Slurm job (no SLURM_JOB_ID, no --slurm-job-id)"
        if self.requested_by is not None:
            return f"job {self.job.job_id} is being requeued already (decision {self.requested_by})"
        if self.job.restarts >= self.max_requeues:
            return (
                f"job {self.job.job_id} was restarted {self.job.restarts} time(s) already "
                f"(SLURM_RESTART_COUNT; --max-requeues {self.max_requeues})"
            )
        return None

    def verdict(self) -> tuple[RuleAction, str]:
        """(action, note for the reason) of a decision that asks for a requeue (the hang's --hang-requeue)."""
        refused = self.refused()
        if refused is not None:
            return RuleAction.ALERT, f"; not requeued: {refused}"
        assert self.job is not None  # refused() said so
        return RuleAction.REQUEUE, (
            f"; requeueing Slurm job {self.job.job_id} (restart {self.job.restarts + 1} of at most "
            f"{self.max_requeues}): it resumes from its newest verified checkpoint"
        )

    def evidence(self) -> Requeue:
        return Requeue(
            job_id=self.job.job_id if self.job else None,
            restarts=self.job.restarts if self.job else None,
            max_requeues=self.max_requeues,
        )

    def take(self, records) -> None:
        """Note the enforced requeue decisions among `records`: serve() carries them out."""
        for d in records or ():
            if (
                d
                and d.get("type", RecordType.DECISION) == RecordType.DECISION
                and d.get("action") == RuleAction.REQUEUE
                and d.get("enforced")
            ):
                self._due.append(d)
                if self._wake is not None:
                    self._wake.set()

    # -- acting (the control app's event loop) ----------------------------------------------
    async def serve(self, persist: Callable[[], Awaitable[None]], record: Record) -> None:
        """Carry out each requeue decision as it is taken (a task of the control app's lifespan)."""
        self._wake = wake = asyncio.Event()
        while True:
            while self._due:
                decision = self._due.pop(0)
                try:
                    await self.carry_out(decision, persist, record)
                except Exception:  # one failed requeue must not end the loop
                    log.exception("requeue for decision %s failed", decision.get("id"))
            await wake.wait()
            wake.clear()

    async def carry_out(self, decision: dict, persist: Callable[[], Awaitable[None]], record: Record) -> None:
        did, rule, step = decision.get("id"), str(decision.get("rule") or "requeue"), decision.get("step")
        refused = self.refused()
        if refused is not None:
            self._note(record, rule, f"requeue (decision {did}) not carried out: {refused}", did, step)
            await persist()
            return
        assert self.job is not None  # refused() said so
        self.requested_by = did
        try:
            await persist()  # the decision is on disk before the job is touched
        except Exception as err:
            self.requested_by = None
            log.error("requeue (decision %s) not carried out: the decision could not be written (%s)", did, err)
            return
        code, output = await asyncio.to_thread(self._scontrol, self.job.job_id)
        if code == 0 or code in ENDED_WITH_THE_JOB:
            log.warning(
                "requeued Slurm job %s (decision %s): Slurm ends its steps and starts it again%s",
                self.job.job_id,
                did,
                f" (scontrol, inside the job, was ended with it: {output})" if code else "",
            )
            return
        self.requested_by = None
        self._note(
            record, rule, f"requeue (decision {did}) failed: scontrol requeue {self.job.job_id}: {output}", did, step
        )
        await persist()

    def _scontrol(self, job_id: str) -> tuple[int, str]:
        """(exit status, its output cut short): `scontrol requeue JOB`, bounded in time."""
        path = shutil.which(self.scontrol)
        if path is None:
            return 127, f"{self.scontrol} not found on PATH"
        try:
            done = subprocess.run(
                [path, "requeue", job_id], capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return 124, f"no answer within {self.timeout:g} s"
        except OSError as err:
            return 126, str(err)
        text = " ".join((done.stderr or done.stdout or "").split())
        return done.returncode, (text or f"exit status {done.returncode}")[:MAX_OUTPUT_CHARS]

    def _note(self, record: Record, rule: str, reason: str, did, step) -> None:
        log.error("%s", reason)
        record(rule, RuleAction.ALERT, reason, RequeueNote(requeue_decision=did, **asdict(self.evidence())), step)
