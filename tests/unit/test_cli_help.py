"""Every `parwatch` subcommand's --help: exits 0 and shows an example; tokens never on the command line."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from parwatch.cli.main import COMMANDS, cli

# What the issue promises the CLI offers (the root registers one module per name).
PROMISED = {
    "demo",
    "sidecar",
    "train",
    "rules",
    "status",
    "pause",
    "resume",
    "rollback",
    "decisions",
    "report",
    "dashboards",
}


def command_paths() -> list[tuple[str, ...]]:
    """Every command and group under the root, as argv prefixes (`rules check` -> ("rules", "check"))."""
    ctx = click.Context(cli)
    paths = []

    def walk(prefix, command):
        paths.append(prefix)
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                walk((*prefix, name), command.get_command(ctx, name))

    for name in cli.list_commands(ctx):
        walk((name,), cli.get_command(ctx, name))
    return paths


PATHS = command_paths()


def test_the_root_registers_every_promised_command():
    assert PROMISED <= set(COMMANDS)
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    for name in PROMISED:
        assert f"  {name}" in result.output


def test_groups_list_their_subcommands():
    assert {("rules", "check"), ("rules", "render-alerts"), ("dashboards", "export"), ("dashboards", "push")} <= set(
        PATHS
    )


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_help_exits_0_and_shows_an_example(path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and f"parwatch {' '.join(path)}" in result.output, result.output


def test_train_help_is_the_trainers_own_help_after_an_example():
    result = CliRunner().invoke(cli, ["train", "--help"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Example" in out and "parwatch train --nproc 4" in out
    # The trainer's argparse help follows: its usage and options are what `train` accepts.
    assert "usage: python -m parwatch.trainer" in out and "--inject SPEC" in out and "--parwatch-endpoint" in out
    assert out.index("Example") < out.index("usage: python -m parwatch.trainer")


def test_rollback_help_offers_to_step():
    assert "--to-step" in CliRunner().invoke(cli, ["rollback", "--help"]).output


def all_options():
    ctx = click.Context(cli)
    for path in PATHS:
        command = cli
        for name in path:
            command = command.get_command(ctx, name)
        for param in command.params:
            if isinstance(param, click.Option):
                yield path, param


def test_no_command_takes_a_token_on_the_command_line():
    for path, option in all_options():
        for flag in option.opts + option.secondary_opts:
            assert flag == "--token-file" or "token" not in flag.lower().replace("-file", ""), (path, flag)


@pytest.mark.parametrize(
    "path", [("status",), ("pause",), ("resume",), ("rollback",), ("decisions",), ("sidecar",)], ids=" ".join
)
def test_commands_that_need_a_token_read_it_from_a_file_or_the_environment(path):
    flags = {flag for p, option in all_options() if p == path for flag in option.opts}
    assert "--token-file" in flags
    assert "PARWATCH_TOKEN" in CliRunner().invoke(cli, [*path, "--help"]).output
