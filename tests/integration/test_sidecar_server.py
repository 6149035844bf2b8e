"""`parwatch sidecar` as a real process: listeners, token, port clash, SIGHUP reload, restarts."""

from __future__ import annotations

import signal
import socket
import subprocess

import httpx
import pytest

from tests.deadline import wait_until
from tests.fixtures import synthetic as syn
from tests.sidecar_process import ROOT, free_port, running_sidecar, sidecar_command, stop, wait_healthy

pytestmark = pytest.mark.integration
CHILD_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}  # and no PARWATCH_TOKEN

RULES_A = """version: 1
rules:
  - name: skew
    metric: pipeline_skew_ratio
    above: 1.5
    action: alert
"""
RULES_B = (
    RULES_A
    + """  - name: nan-loss
    metric: loss
    check: finite
    action: rollback
"""
)


def post_steps(url, steps, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    for step in steps:
        body = {
            "version": 1,
            "summaries": [
                syn.summary(r, step, checkpoints=[1], time=float(step), global_stages=stages if r == 0 else None)
                for r in (0, 1)
            ],
        }
        r = httpx.post(f"{url}/v1/ingest", json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text


def wait_for(predicate, timeout=30.0, what="condition"):
    return wait_until(predicate, what, timeout)


def test_serves_metrics_and_control_on_separate_listeners(tmp_path):
    with running_sidecar(tmp_path / "state", token="tok") as sp:
        assert httpx.get(f"{sp.metrics_url}/healthz").json() == {"ok": True, "pid": sp.proc.pid}
        assert httpx.post(f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": []}).status_code == 401
        post_steps(sp.control_url, [1, 2, 3], token="tok")
        text = httpx.get(f"{sp.metrics_url}/metrics").text
        assert 'parwatch_stage_bubble_ratio{rank="1",stage="1"}' in text and "parwatch_train_step 3.0" in text
        assert httpx.get(f"{sp.metrics_url}/v1/status").status_code == 404  # metrics listener is read-only
        assert httpx.get(f"{sp.control_url}/openapi.json").status_code == 401
        assert "/v1/ingest" in httpx.get(f"{sp.control_url}/openapi.json", headers=sp.headers).json()["paths"]
        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(30) == 0


def test_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            sidecar_command(
                "--state-dir",
                str(tmp_path),
                "--metrics-listen",
                f"127.0.0.1:{port}",
                "--control-listen",
                f"127.0.0.1:{free_port()}",
            ),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=CHILD_ENV,
        )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert errors == [
        f"Error: port {port} is already in use (--metrics-listen 127.0.0.1:{port}); stop the other "
        f"process or pick another port with --metrics-listen HOST:PORT"
    ]


def test_refuses_public_control_listener_without_token(tmp_path):
    proc = subprocess.run(
        sidecar_command(
            "--state-dir",
            str(tmp_path),
            "--metrics-listen",
            f"127.0.0.1:{free_port()}",
            "--control-listen",
            f"0.0.0.0:{free_port()}",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=CHILD_ENV,
    )
    assert proc.returncode != 0 and "no token is set" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_launcher_waits_for_its_own_sidecar_not_another_on_the_port(tmp_path):
    """CI on 3c6403a: a port free a moment before was another test's sidecar's by the time this one bound;
    the launcher took the other's /healthz for its own and the test read the other's 401 as a status. The
    second sidecar, on the first's port, must be told exited, never healthy."""
    with running_sidecar(tmp_path / "first") as first:
        listen = ["--metrics-listen", f"127.0.0.1:{free_port()}", "--control-listen", first.control_url[7:]]
        with open(tmp_path / "second.log", "wb") as log:
            second = subprocess.Popen(
                sidecar_command("--state-dir", str(tmp_path / "second"), *listen),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=CHILD_ENV,
            )
        try:
            with pytest.raises(RuntimeError, match="exited"):
                wait_healthy(f"{first.control_url}/healthz", second, 60)
        finally:
            stop(second)
        assert "already in use" in (tmp_path / "second.log").read_text()


def test_sighup_reloads_rules_and_keeps_them_when_invalid(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES_A)
    with running_sidecar(tmp_path / "state", "--rules", str(rules)) as sp:
        status = lambda: httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()  # noqa: E731
        assert set(status()["rules"]) == {"skew"}
        rules.write_text(RULES_B.replace("finite", "finit"))
        sp.proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: "parwatch_sidecar_rules_reload_failures_total 1.0" in httpx.get(f"{sp.metrics_url}/metrics").text,
            what="the reload failure to be counted",
        )
        assert set(status()["rules"]) == {"skew"}
        assert "did you mean 'finite'" in sp.log()
        rules.write_text(RULES_B)
        sp.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: set(status()["rules"]) == {"skew", "nan-loss"}, what="the new rules")
        assert sp.proc.poll() is None


def test_decisions_and_pending_directive_survive_a_restart(tmp_path):
    state = tmp_path / "state"
    with running_sidecar(state) as sp:
        post_steps(sp.control_url, [1, 2], sp.token)
        r = httpx.post(
            f"{sp.control_url}/v1/control", json={"action": "pause", "reason": "before restart"}, headers=sp.headers
        )
        directive_id = r.json()["directive_id"]
    with running_sidecar(state) as sp:
        status = httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()
        assert status["pending_directive"]["id"] == directive_id
        assert status["last_decisions"][-1]["reason"] == "before restart"
        assert status["ranks"] == {}  # the store starts empty; the engine's state does not
        summaries = [syn.summary(r, 3) for r in (0, 1)]
        reply = httpx.post(
            f"{sp.control_url}/v1/ingest",
            json={"version": 1, "summaries": summaries, "outcomes": [syn.outcome(directive_id, step=3)]},
            headers=sp.headers,
        ).json()
        assert reply["directive"] is None
        assert httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers).json()["paused"] is True
