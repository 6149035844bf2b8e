"""`parwatch status/pause/resume/rollback/decisions` against a real control app on loopback."""

from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn
from click.testing import CliRunner

from parwatch.cli.control import decisions, pause, resume, rollback, status
from parwatch.client import SidecarClient, SidecarError
from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import Listen, SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn
from tests.sidecar_process import free_port

TOKEN = "cli-token"


@pytest.fixture
def served(tmp_path):
    """A control app with a token, under uvicorn in a thread; yields (endpoint, token file)."""
    port = free_port()
    sidecar = build_sidecar(
        SidecarConfig(state_dir=tmp_path / "state", token=TOKEN, control_listen=Listen("127.0.0.1", port))
    )
    server = uvicorn.Server(
        uvicorn.Config(create_control_app(sidecar), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        endpoint = f"http://127.0.0.1:{port}"
        with SidecarClient(endpoint, TOKEN) as client:
            client.ingest([syn.summary(r, 1, checkpoints=[1], global_stages=[]) for r in (0, 1)])
        yield endpoint, str(token_file)
    finally:
        server.should_exit = True
        thread.join(10)


def cli(command, served, *args):
    endpoint, token_file = served
    return CliRunner().invoke(command, ["--endpoint", endpoint, "--token-file", token_file, *args])


def test_pause_then_status_shows_the_pending_directive(served):
    result = cli(pause, served, "--reason", "inspect")
    assert result.exit_code == 0, result.output
    assert "action=pause" in result.output and "source=operator" in result.output
    out = cli(status, served).output
    assert "run synthetic" in out and "ranks: 2 reporting" in out and '"action": "pause"' in out
    as_json = json.loads(cli(status, served, "--json").output)
    assert as_json["pending_directive"]["reason"] == "inspect"


def test_rollback_and_resume_and_decisions(served):
    result = cli(rollback, served, "--to-step", "1", "--skip-batches", "2", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["action"] == "rollback" and record["checkpoint"] == 1 and record["skip_batches"] == 2
    assert record["requested_by"].startswith("operator")
    assert cli(resume, served).exit_code == 0
    listed = json.loads(cli(decisions, served, "--limit", "5", "--json").output)
    assert [d["action"] for d in listed] == ["rollback", "resume"]


def test_refusals_and_bad_tokens_are_one_line_errors(served, tmp_path):
    result = cli(rollback, served, "--to-step", "99")
    assert result.exit_code == 1 and "400" in result.output and "not a known verified checkpoint" in result.output
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    result = CliRunner().invoke(status, ["--endpoint", served[0], "--token-file", str(wrong)])
    assert result.exit_code == 1 and "401 wrong bearer token" in result.output


def test_unreachable_sidecar():
    with pytest.raises(SidecarError, match="cannot reach the sidecar"):
        SidecarClient(f"http://127.0.0.1:{free_port()}", timeout=2).status()
