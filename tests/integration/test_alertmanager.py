"""A real Alertmanager calls the sidecar's webhook (bearer token): a firing alert labelled
parwatch_action=pause becomes a pending pause directive; its resolution clears the dedupe."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import sqlite3
import subprocess
import time

import httpx
import pytest

from tests import one_client
from tests.deadline import wait_until
from tests.fixtures import synthetic as syn
from tests.sidecar_process import free_port, running_sidecar, stop

pytestmark = pytest.mark.integration

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
TOKEN = "am-webhook-token"

needs_alertmanager = pytest.mark.skipif(
    not os.path.exists(ALERTMANAGER), reason="prometheus-alertmanager is not installed (Debian package)"
)


@contextlib.contextmanager
def alertmanager(tmp_path, webhook_url: str):
    """Yields (url, seconds it took to become ready)."""
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text(f"""
route:
  receiver: parwatch
  group_by: [alertname]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: parwatch
    webhook_configs:
      - url: {webhook_url}
        send_resolved: true
        http_config:
          authorization:
            credentials: {TOKEN}
""")
    log = open(tmp_path / "alertmanager.log", "wb")
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if one_client.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() - started < 60, "Alertmanager did not become ready in 60 s"
            time.sleep(0.1)
        yield url, time.monotonic() - started
    finally:
        stop(proc)
        log.close()


def wait_for(predicate, timeout, what):
    return wait_until(predicate, what, timeout, interval=0.2)


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@needs_alertmanager
def test_firing_alert_pauses_the_run_through_the_webhook(tmp_path, record_property):
    state = tmp_path / "state"
    with running_sidecar(state, token=TOKEN) as sp:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"version": 1, "summaries": [syn.summary(r, 1, global_stages=[]) for r in (0, 1)]}
        assert one_client.post(f"{sp.control_url}/v1/ingest", json=body, headers=auth).status_code == 200
        status = lambda: one_client.get(f"{sp.control_url}/v1/status", headers=auth).json()  # noqa: E731
        assert status()["pending_directive"] is None

        with alertmanager(tmp_path, f"{sp.control_url}/v1/alerts") as (am, startup_seconds):
            record_property("alertmanager_startup_seconds", round(startup_seconds, 2))
            print(f"\nAlertmanager took {startup_seconds:.2f} s to become ready")
            now = dt.datetime.now(dt.timezone.utc)
            alert = {
                "labels": {
                    "alertname": "ParwatchBubbleExcess",
                    "parwatch_action": "pause",
                    "rule": "bubble-excess",
                    "severity": "page",
                },
                "annotations": {"summary": "max bubble_excess_ratio above 0.1"},
                "startsAt": iso(now),
            }
            posted = time.monotonic()
            r = one_client.post(f"{am}/api/v2/alerts", json=[alert], timeout=10)
            assert r.status_code == 200, r.text

            directive = wait_for(lambda: status()["pending_directive"], 30, "the pause directive")
            print(f"webhook delivered the pause {time.monotonic() - posted:.2f} s after the alert was posted")
            assert directive["action"] == "pause"
            decision = [d for d in status()["last_decisions"] if d["type"] == "decision"][-1]
            assert decision["source"] == "alertmanager" and decision["requested_by"] == "alertmanager:parwatch"
            assert decision["reason"] == "ParwatchBubbleExcess: max bubble_excess_ratio above 0.1"

            def acted() -> int:
                with sqlite3.connect(state / "parwatch.db") as db:
                    return db.execute("SELECT count(*) FROM alerts_acted").fetchone()[0]

            assert acted() == 1

            # Resolve it: Alertmanager sends "resolved" and the sidecar forgets the fingerprint.
            alert["endsAt"] = iso(dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1))
            assert one_client.post(f"{am}/api/v2/alerts", json=[alert], timeout=10).status_code == 200
            wait_for(lambda: acted() == 0, 30, "the resolved notification")
            decisions = [d for d in status()["last_decisions"] if d["type"] == "decision"]
            assert len(decisions) == 1  # resolution does not act
