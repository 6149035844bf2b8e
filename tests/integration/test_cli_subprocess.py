"""`parwatch` as a user runs it: each failure is one line on stderr naming the cause and the
fix, with a non-zero exit; tokens come from a file or the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.sidecar_process import ROOT, free_port, running_sidecar

pytestmark = pytest.mark.integration


def parwatch(*args: str, env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "parwatch.cli.main", *args],
        capture_output=True,
        text=True,
        env=child_env,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def without_token() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PARWATCH_TOKEN", "PARWATCH_ENDPOINT")}


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The failure's stderr, asserted to be a single line; stdout stays clean."""
    assert result.returncode != 0, (result.stdout, result.stderr)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


def test_unreachable_sidecar():
    closed = free_port()  # bound a moment ago, nothing listens there now
    line = one_line_error(parwatch("status", "--endpoint", f"http://127.0.0.1:{closed}", env=without_token()))
    assert f"127.0.0.1:{closed}" in line and "cannot reach the sidecar" in line
    assert "--endpoint" in line and "parwatch sidecar" in line  # the fix


@pytest.fixture(scope="module")
def sidecar_with_token(tmp_path_factory):
    with running_sidecar(tmp_path_factory.mktemp("tok") / "state", token="the-right-token") as sp:
        yield sp


def test_wrong_token_from_a_file(sidecar_with_token, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("not-the-token\n")
    line = one_line_error(
        parwatch(
            "pause", "--endpoint", sidecar_with_token.control_url, "--token-file", str(token_file), env=without_token()
        )
    )
    assert "401" in line and "token" in line
    assert "--token-file" in line and "PARWATCH_TOKEN" in line  # the fix


def test_wrong_and_missing_token_from_the_environment(sidecar_with_token):
    wrong = dict(without_token(), PARWATCH_TOKEN="nope")
    line = one_line_error(parwatch("status", "--endpoint", sidecar_with_token.control_url, env=wrong))
    assert "401 wrong bearer token" in line and "--token-file" in line
    line = one_line_error(parwatch("decisions", "--endpoint", sidecar_with_token.control_url, env=without_token()))
    assert "401" in line and "PARWATCH_TOKEN" in line


def test_right_token_from_the_environment_or_a_file(sidecar_with_token, tmp_path):
    env = dict(without_token(), PARWATCH_TOKEN="the-right-token", PARWATCH_ENDPOINT=sidecar_with_token.control_url)
    result = parwatch("status", env=env)  # endpoint from the environment too
    assert result.returncode == 0, result.stderr
    assert "rule nonfinite-loss: ok" in result.stdout
    token_file = tmp_path / "token"
    token_file.write_text("the-right-token\n")
    result = parwatch(
        "decisions", "--endpoint", sidecar_with_token.control_url, "--token-file", str(token_file), env=without_token()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no decisions yet"


BAD_RULES = """version: 1
rules:
  - name: skew
    metric: pipeline_skew_ratio
    above: 1.5
    for_stepz: 3
    action: alert
"""


def test_invalid_rules_name_file_line_and_field(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(BAD_RULES)
    line = one_line_error(parwatch("rules", "check", str(rules)))
    assert line.startswith(f"{rules}:6: ") and "'skew'" in line and "for_stepz" in line
    assert "did you mean 'for_steps'" in line  # the fix


def test_sidecar_refuses_invalid_rules_in_one_line(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(BAD_RULES)
    result = parwatch(
        "sidecar",
        "--rules",
        str(rules),
        "--state-dir",
        str(tmp_path / "state"),
        "--metrics-listen",
        f"127.0.0.1:{free_port()}",
        "--control-listen",
        f"127.0.0.1:{free_port()}",
    )
    line = one_line_error(result)
    assert f"{rules}:6:" in line and "for_stepz" in line


def test_metrics_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = parwatch(
            "sidecar",
            "--state-dir",
            str(tmp_path / "state"),
            "--metrics-listen",
            f"127.0.0.1:{port}",
            "--control-listen",
            f"127.0.0.1:{free_port()}",
        )
    line = one_line_error(result)
    assert f"port {port}" in line and "in use" in line and "--metrics-listen" in line


def test_bad_inject_spec():
    line = one_line_error(parwatch("train", "--nproc", "1", "--steps", "1", "--inject", "bogus"))
    assert "--inject 'bogus'" in line and "unknown fault" in line
    assert "straggler:stage=1" in line  # the fix: the specs it accepts


def test_train_help_prints_the_trainers_help_and_exits_0():
    result = parwatch("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "Example" in result.stdout and "usage: python -m parwatch.trainer" in result.stdout
    assert "--inject SPEC" in result.stdout
