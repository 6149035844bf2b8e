"""The `parwatch` command: a thin root that registers one module per subcommand.

Subcommands are imported only when used, so `parwatch status` does not pay for
importing torch or matplotlib.
"""

from __future__ import annotations

import importlib

import click

from parwatch import __version__

# name -> "module:attribute" of a click command or group.
COMMANDS = {
    "demo": "parwatch.cli.demo:demo",
    "train": "parwatch.cli.train:train",
    "sidecar": "parwatch.cli.sidecar:sidecar",
    "credential": "parwatch.cli.credential:credential",
    "rules": "parwatch.cli.rules:rules",
    "status": "parwatch.cli.control:status",
    "pause": "parwatch.cli.control:pause",
    "resume": "parwatch.cli.control:resume",
    "rollback": "parwatch.cli.control:rollback",
    "cancel": "parwatch.cli.control:cancel",
    "decisions": "parwatch.cli.control:decisions",
    "report": "parwatch.cli.report:report",
    "dashboards": "parwatch.cli.dashboards:dashboards",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="parwatch")
def cli():
    """parwatch: watch tensor + pipeline parallel training, and act on what it sees.

    \b
    Example:
      parwatch demo                      # trainer + collector + sidecar on this machine
      parwatch sidecar --rules rules.yaml --state-dir /var/lib/parwatch
      parwatch status --endpoint http://127.0.0.1:9401
    """


if __name__ == "__main__":
    cli()
