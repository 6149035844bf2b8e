"""--hang-dump-stacks against a real sidecar process (issue 25, item 2): on 8fae0f2 an activity report naming
another process's pid made the sidecar send that process SIGUSR1 when the hang was named (an unrelated
process died). A pid is signalled only when its own process sent the report, over its own connection
(parwatch/sidecar/pid_owner.py); the hung rank that reports for itself still gets its stacks dumped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests import one_client
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RANK_1 = """
import faulthandler, signal, socket, sys, threading, time
import httpx
url, token, stacks = sys.argv[1:4]
faulthandler.register(signal.SIGUSR1, file=open(stacks, "a"), all_threads=True)
client = httpx.Client(headers={"Authorization": "Bearer " + token}, timeout=10)
def report():
    step, ended = 0, time.time()
    while True:
        if step < 3:
            step, ended = step + 1, time.time()
        now = time.time()
        a = {"run_id": "r1", "rank": 1, "pid": __import__("os").getpid(), "host": sys.argv[4], "stage": 1,
             "tp_rank": 0, "dp_rank": 0, "tp": 1, "pp": 2, "dp": 1, "state": "running", "step": step,
             "step_seconds": 0.1, "kind": "forward", "op": None, "group": None, "peer": None, "seq": None,
             "since": ended, "time": now, "step_end": ended}
        client.post(url + "/v1/activity", json={"version": 1, "activity": a}).raise_for_status()
        time.sleep(0.3)
threading.Thread(target=report, daemon=True).start()
print("ready", flush=True)
def stuck_in_forward():
    time.sleep(120)
stuck_in_forward()
"""


def report(rank: int, step: int, pid: int, ended: float, **more) -> dict:
    a = {
        "run_id": "r1",
        "rank": rank,
        "pid": pid,
        "host": socket.gethostname(),
        "stage": rank,
        "tp_rank": 0,
        "dp_rank": 0,
        "tp": 1,
        "pp": 2,
        "dp": 1,
        "state": "running",
        "step": step,
        "step_seconds": 0.1,
        "kind": "forward",
        "op": None,
        "group": None,
        "peer": None,
        "seq": None,
        "since": ended,
        "time": time.time(),
        "step_end": ended,
        **more,
    }
    return {"version": 1, "activity": a}


class Poster:
    """Reports from this test process, every 0.3 s: rank 0 waiting on rank 1, and (forged) rank 1 too."""

    def __init__(self, sp, forged_rank1_pid: int | None):
        self.sp, self.forged, self.stop = sp, forged_rank1_pid, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        step, ended = 0, time.time()
        with httpx.Client(headers=self.sp.headers, timeout=10) as client:
            while not self.stop.is_set():
                if step < 3:  # three steps, then stuck: step 3's boundary stays where it was
                    step, ended = step + 1, time.time()
                waiting = report(0, step, os.getpid(), ended, kind="recv", op="recv", group="pp", peer=1)
                client.post(f"{self.sp.control_url}/v1/activity", json=waiting)
                if self.forged is not None:
                    client.post(f"{self.sp.control_url}/v1/activity", json=report(1, step, self.forged, ended))
                time.sleep(0.3)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def _hang(sp) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        hang = one_client.get(f"{sp.control_url}/v1/hang", headers=sp.headers, timeout=10).json().get("hang")
        if hang:
            return hang
        time.sleep(0.3)
    raise AssertionError("no hang named in 60 s")


def test_a_pid_named_by_another_process_is_never_signalled(tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with running_sidecar(tmp_path / "state", "--hang-dump-stacks", "--hang-min-seconds", "2") as sp:
            with Poster(sp, forged_rank1_pid=stranger.pid):
                hang = _hang(sp)
                time.sleep(2)  # a signal would have been sent at once
                log = sp.log()
        assert hang["evidence"]["culprit"]["pid"] == stranger.pid
        assert stranger.poll() is None, "the stranger was signalled (SIGUSR1's default action ends it)"
        assert f"not signalling pid {stranger.pid}" in log
    finally:
        stranger.kill()
        stranger.wait()


def test_the_hung_rank_that_reports_for_itself_has_its_stacks_dumped(tmp_path):
    stacks = tmp_path / "stacks.txt"
    with running_sidecar(tmp_path / "state", "--hang-dump-stacks", "--hang-min-seconds", "2") as sp:
        token = sp.headers["Authorization"].split()[1]
        rank1 = subprocess.Popen(
            [sys.executable, "-c", RANK_1, sp.control_url, token, str(stacks), socket.gethostname()],
            stdout=subprocess.PIPE,
        )
        try:
            assert rank1.stdout.readline().strip() == b"ready"
            with Poster(sp, forged_rank1_pid=None):
                hang = _hang(sp)
                deadline = time.monotonic() + 10
                while "stuck_in_forward" not in (stacks.read_text() if stacks.exists() else ""):
                    assert time.monotonic() < deadline, f"no stack dump from rank 1:\n{sp.log()[-2000:]}"
                    time.sleep(0.1)
        finally:
            rank1.kill()
            rank1.wait()
    assert hang["evidence"]["culprit"]["pid"] == rank1.pid
