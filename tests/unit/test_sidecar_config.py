"""Settings, token rules and the `parwatch sidecar` command line (nothing is bound here)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from parwatch.cli.sidecar import sidecar as sidecar_cmd
from parwatch.sidecar.config import ConfigError, Listen, SidecarConfig, is_loopback, parse_listen
from parwatch.tokens import TokenError, read_token


@pytest.mark.parametrize(
    "value, expected",
    [
        ("127.0.0.1:9401", Listen("127.0.0.1", 9401)),
        ("0.0.0.0:9400", Listen("0.0.0.0", 9400)),
        ("[::1]:9401", Listen("::1", 9401)),
        ("localhost:80", Listen("localhost", 80)),
    ],
)
def test_parse_listen(value, expected):
    assert parse_listen(value, "--control-listen") == expected


@pytest.mark.parametrize("value", ["9401", "host:", ":9401", "host:port", "host:70000"])
def test_parse_listen_errors_name_the_flag(value):
    with pytest.raises(ConfigError, match=r"--metrics-listen .* is not HOST:PORT; e.g. --metrics-listen"):
        parse_listen(value, "--metrics-listen")


@pytest.mark.parametrize(
    "host, loop",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_non_loopback_control_needs_a_token():
    with pytest.raises(ConfigError, match="not a loopback address and no token is set"):
        SidecarConfig(control_listen=Listen("0.0.0.0", 9401))
    assert SidecarConfig(control_listen=Listen("0.0.0.0", 9401), token="t").token == "t"
    assert SidecarConfig().token is None  # loopback, no token: fine


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"rank_grace_seconds": 0}, "--rank-grace-seconds must be > 0"),
        ({"max_body_bytes": 10}, "--max-body-bytes must be >= 1024"),
        ({"metrics_listen": Listen("127.0.0.1", 9401)}, "give them different ports"),
    ],
)
def test_settings_are_checked(kw, message):
    with pytest.raises(ConfigError, match=message):
        SidecarConfig(**kw)


def test_read_token(tmp_path):
    f = tmp_path / "token"
    f.write_text("  abc\n")
    assert read_token(f, environ={"PARWATCH_TOKEN": "env"}) == "abc"
    assert read_token(None, environ={"PARWATCH_TOKEN": "env"}) == "env"
    assert read_token(None, environ={}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="is empty"):
        read_token(tmp_path / "empty")
    with pytest.raises(TokenError, match="cannot read it"):
        read_token(tmp_path / "missing")


def test_help_documents_every_flag_with_an_example():
    out = CliRunner().invoke(sidecar_cmd, ["--help"], terminal_width=200).output
    for flag in (
        "--rules",
        "--state-dir",
        "--metrics-listen",
        "--control-listen",
        "--token-file",
        "--rank-grace-seconds",
        "--max-body-bytes",
    ):
        assert flag in out
        assert f"e.g. {flag}" in " ".join(out.split()), f"{flag} has no example"
    assert "PARWATCH_TOKEN" in out and "SIGHUP" in out


def run_cli(*args, env=None):
    return CliRunner().invoke(sidecar_cmd, list(args), env=env or {"PARWATCH_TOKEN": ""})


def test_refuses_public_control_without_token_in_one_line(tmp_path):
    result = run_cli("--control-listen", "0.0.0.0:9401", "--state-dir", str(tmp_path))
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0] and "0.0.0.0:9401" in lines[0]


def test_invalid_rules_file_lists_the_problems(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: a\n    metric: loss\n    check: finite\n    action: explode\n")
    result = run_cli("--rules", str(rules), "--state-dir", str(tmp_path / "s"))
    assert result.exit_code != 0
    assert "invalid --rules file" in result.output and "rules.yaml:6" in result.output
    assert len(result.output.strip().splitlines()) == 1  # one line naming file:line, field and fix


def test_bad_listen_value_is_one_line(tmp_path):
    result = run_cli("--metrics-listen", "nine-four-hundred", "--state-dir", str(tmp_path))
    assert result.exit_code != 0 and "--metrics-listen 'nine-four-hundred' is not HOST:PORT" in result.output
