"""`parwatch train`: the bundled trainer with the collector attached."""

from __future__ import annotations

import sys

import click


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def train(ctx):
    """Run the reference TP+PP trainer with parwatch's collector attached.

    Every flag of `python -m trainer` is accepted (see `parwatch train --help`);
    `--parwatch on` is implied.

    \b
    Example:
      parwatch train --nproc 4 --tp 2 --pp 2 --microbatches 8 --steps 100 \\
          --parwatch-endpoint http://127.0.0.1:9401 --parwatch-log runs/r1
    """
    from trainer.launch import main

    args = list(ctx.args)
    if "--parwatch" not in args:
        args = ["--parwatch", "on", *args]
    sys.exit(main(args))
