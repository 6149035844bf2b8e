"""Issue 43, findings 7 and 8 (the state dir), against real sidecars and real file systems: one sidecar per state
dir; a state dir that cannot be written refuses the start; a write that fails mid-run answers 503, decides
nothing and queues no directive; the WAL is checkpointed at shutdown.

Read-only and full disks are real: a small tmpfs, mounted read-only or filled (the tests run as root here).
Where mounting is not permitted (a CI runner without root) the read-only case is a directory of mode 0555 and
the full disk is the sidecar's RLIMIT_FSIZE lowered from outside (prlimit): a write then fails with EFBIG, as it
fails with ENOSPC on a full disk.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest

from parwatch.ports import free_port
from tests import one_client
from tests.fixtures import synthetic as syn
from tests.integration.trust_util import STAGES, ingest, post
from tests.sidecar_process import ROOT, running_sidecar, sidecar_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    """A tmpfs of `size` at `path`; None when this host does not let the tests mount one."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]).returncode:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def start_fails(state: Path, *extra: str, **popen) -> str:
    """Start a sidecar that must refuse to start; its error output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ports = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    args = ["--state-dir", str(state), "--metrics-listen", ports[0], "--control-listen", ports[1], *extra]
    done = subprocess.run(sidecar_command(*args), capture_output=True, text=True, timeout=30, env=env, **popen)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def test_a_second_sidecar_on_a_state_dir_refuses_to_start_naming_the_first(tmp_path):
    """Two sidecars on one state dir archived each other's runs and handed out one directive id twice."""
    with running_sidecar(tmp_path / "state") as first:
        error = start_fails(tmp_path / "state")
        assert f"pid {first.pid}" in error and "--state-dir" in error and "in use" in error
        assert one_client.get(f"{first.control_url}/healthz").status_code == 200


def test_a_state_dir_that_cannot_be_written_refuses_the_start(tmp_path):
    """A read-only or full state dir (one a sidecar used before) let the sidecar start, then every ingest and
    control answered 500."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        state = (disk or tmp_path / "disk") / "state"
        with running_sidecar(state) as sp:  # a state dir in use: its database, log and token are there
            ingest(sp, *[syn.summary(r, 1, global_stages=STAGES if r == 0 else None) for r in (0, 1)])
            assert post(sp, "/v1/control", {"action": "pause"}).status_code == 200
        if disk is not None:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:  # no mount here: a directory the sidecar's user cannot write (root could)
            state.chmod(0o555)
        error = start_fails(state)
        assert "--state-dir" in error and ("Read-only" in error or "ermission" in error), error
        limit = None
        if disk is not None:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
            Filler(disk, state, 0).fill()
        else:  # the sidecar may write no file past 16 KB (its probe needs more): EFBIG, as a full disk's ENOSPC
            state.chmod(0o755)
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))  # noqa: E731
        error = start_fails(state, preexec_fn=limit)
        assert "--state-dir" in error and ("No space" in error or "too large" in error), error


class Filler:
    """Fills (and frees) the file system of a state dir: a tmpfs when mounted, else the sidecar's RLIMIT_FSIZE."""

    def __init__(self, disk: Path | None, state: Path, pid: int):
        self.disk, self.state, self.pid = disk, state, pid

    def fill(self) -> None:
        if self.disk is None:
            sizes = [p.stat().st_size for p in self.state.iterdir() if p.is_file()]
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (max(sizes), resource.RLIM_INFINITY))
            return
        with open(self.disk / "filler", "ab") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()

    def free(self) -> None:
        if self.disk is None:
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        else:
            (self.disk / "filler").unlink()


def _records(state: Path) -> list[dict]:
    with contextlib.closing(sqlite3.connect(state / "parwatch.db")) as db:
        return [json.loads(line) for (line,) in db.execute("SELECT line FROM records")]


def _directives(state: Path) -> list[int]:
    with contextlib.closing(sqlite3.connect(state / "parwatch.db")) as db:
        return [i for (i,) in db.execute("SELECT id FROM directives")]


def test_a_full_disk_mid_run_decides_nothing_and_hands_out_no_directive(tmp_path):
    """Finding 7: on a full state dir, decisions answered 500 stayed queued as directives and were delivered
    later with no record in the database or decisions.jsonl; retries queued duplicates. Three fills, each with
    an operator's pause and a NaN that the rules would roll back (no checkpoint: a pause): while full, each is a
    503 naming the state dir and nothing is queued; once freed, each is decided once, with its record."""
    with tmpfs(tmp_path / "disk", "6m") as disk:
        state = (disk or tmp_path / "disk") / "state"
        with running_sidecar(state) as sp:
            filler = Filler(disk, state, sp.pid)
            handed_out: set[int] = set()
            step = 0

            def rank0(loss: float = 2.0) -> httpx.Response:
                nonlocal step
                step += 1
                body = [
                    syn.summary(r, step, global_stages=STAGES if r == 0 else None, global_loss=loss) for r in (0, 1)
                ]
                r = ingest(sp, *body)
                if r.status_code == 200 and r.json()["directive"]:
                    handed_out.add(r.json()["directive"]["id"])
                return r

            for _ in range(3):
                assert rank0().status_code == 200
            for cycle in range(3):
                before = {d["id"] for d in _records(state) if d["type"] == "decision"}
                filler.fill()
                answers = [post(sp, "/v1/control", {"action": "pause", "reason": f"fill {cycle}"}), rank0(math.nan)]
                answers += [post(sp, "/v1/control", {"action": "pause"}) for _ in range(3)]  # retries
                for r in answers:
                    assert r.status_code == 503 and "could not be written" in r.json()["detail"], r.text
                status = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()
                assert status["pending_directive"] is None and status["directives"] == []
                filler.free()
                made = post(sp, "/v1/control", {"action": "pause", "reason": f"freed {cycle}"})
                assert made.status_code == 200 and made.json()["directive_id"] is not None, made.text
                step -= 1  # rank 0 posts the NaN step again (its shipper would have dropped it): judged now
                assert rank0(math.nan).json()["directive"]["id"] == made.json()["directive_id"]
                records = _records(state)
                decided = [d for d in records if d["type"] == "decision" and d["id"] not in before]
                assert [d["reason"] for d in decided][0] == f"freed {cycle}"  # nothing of the full disk's
                assert [d["rule"] for d in decided[1:]] == ["nonfinite-loss"]  # the NaN, judged once
                # No directive without a decision: every one handed out or queued has its record.
                made_ids = {d["directive_id"] for d in records if d["type"] == "decision"}
                assert handed_out | set(_directives(state)) <= made_ids
                resume = post(sp, "/v1/control", {"action": "resume"})
                assert resume.status_code == 200
                rank0()
                outcomes = [syn.outcome(i, step=step) for i in sorted(set(_directives(state)))]
                assert post(sp, "/v1/ingest", {"version": 1, "summaries": [], "outcomes": outcomes}).status_code == 200
            log = (state / "decisions.jsonl").read_text().splitlines()
            assert {json.loads(line)["type"] for line in log} >= {"decision", "delivered"}
            assert "Traceback" not in sp.log() and "could not be written" in sp.log()


def test_the_wal_is_checkpointed_at_shutdown(tmp_path):
    """Finding 8: the WAL was never checkpointed at shutdown: the state dir held its changes in parwatch.db-wal."""
    state = tmp_path / "state"
    with running_sidecar(state) as sp:
        for step in (1, 2, 3):
            ingest(sp, *[syn.summary(r, step, global_stages=STAGES if r == 0 else None) for r in (0, 1)])
        assert post(sp, "/v1/control", {"action": "pause"}).status_code == 200
        sp.proc.terminate()
        assert sp.proc.wait(30) == 0
    wal = state / "parwatch.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
