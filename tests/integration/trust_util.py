"""What the issue-43 tests share: a rank's credential, summaries of a real process, and an attacker that
posts from another process (a long-lived helper: a connection the rank's own process does not hold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from parwatch.credentials import rank_credential
from parwatch.sidecar.pid_owner import process_started
from tests import one_client
from tests.fixtures import synthetic as syn

STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
MY_START = process_started(os.getpid())
"""This test process's real start, as its collector would say it: it plays the real ranks."""

_HELPER = r"""
import json, sys, httpx
client = httpx.Client(timeout=10, trust_env=False)
print("ready", flush=True)
for line in sys.stdin:
    url, headers, body = json.loads(line)
    try:
        r = client.post(url, content=body.encode(), headers={**headers, "content-type": "application/json"})
        out = [r.status_code, r.text[:2000]]
    except httpx.HTTPError as err:
        out = [0, repr(err)]
    print(json.dumps(out), flush=True)
"""


def rank_headers(sp, run_id: str, rank: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {rank_credential(sp.token, run_id, rank)}"}


def summary(rank: int, step: int, run_id: str = "r1", *, real: bool = True, **kw) -> dict:
    """A summary of rank `rank` (tp=1, pp=2) posted by this process: its pid and real start when `real`."""
    s = syn.summary(rank, step, run_id=run_id, time=time.time(), global_stages=STAGES if rank == 0 else None, **kw)
    s["instances"] = None
    if real:
        s["pid"], s["process_start_time"] = os.getpid(), MY_START
        lived = time.time() - MY_START
        s["time_seconds"] = {**dict.fromkeys(s["time_seconds"], 0.0), "startup": lived * 0.5, "productive": lived * 0.4}
    return s


def post(sp, path: str, body, headers=None, timeout: float = 10) -> httpx.Response:
    return one_client.post(
        f"{sp.control_url}{path}", json=body, headers=sp.headers if headers is None else headers, timeout=timeout
    )


def ingest(sp, *summaries, headers=None, **extra) -> httpx.Response:
    return post(sp, "/v1/ingest", {"version": 1, "summaries": list(summaries), **extra}, headers)


def decisions(sp, rule: str | None = None) -> list[dict]:
    got = one_client.get(f"{sp.control_url}/v1/decisions?limit=1000", headers=sp.headers, timeout=10).json()
    return [d for d in got if d.get("type") == "decision" and (rule is None or d.get("rule") == rule)]


class Elsewhere:
    """Posts from another process: what an attacker holding a credential, but not the rank's process, can do."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def post(self, sp, path: str, body, headers: dict) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([f"{sp.control_url}{path}", headers, json.dumps(body)]) + "\n")
        self.proc.stdin.flush()
        status, text = json.loads(self.proc.stdout.readline())
        return status, text

    def ingest(self, sp, *summaries, headers: dict) -> tuple[int, str]:
        return self.post(sp, "/v1/ingest", {"version": 1, "summaries": list(summaries)}, headers)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
