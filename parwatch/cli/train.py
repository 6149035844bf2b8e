"""`parwatch train`: the bundled trainer with the collector attached."""

from __future__ import annotations

import sys

import click

HELP_HEADER = """\
Usage: parwatch train [TRAINER OPTIONS]

  Run the reference TP+PP trainer with parwatch's collector attached
  (--parwatch on is implied). Every option of `python -m parwatch.trainer` is accepted.

Example:
  parwatch train --nproc 4 --tp 2 --pp 2 --microbatches 8 --steps 100 \\
      --parwatch-endpoint http://127.0.0.1:9401 --parwatch-log runs/r1
  parwatch train --nproc 4 --tp 2 --pp 2 --steps 40 --checkpoint-dir ckpt --checkpoint-every 5 \\
      --inject bad-batch:step=21   # a NaN batch: re-run before the optimizer step, then skipped

The trainer's options follow.
"""


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def train(ctx):
    """Run the reference TP+PP trainer with parwatch's collector attached.

    Every flag of `python -m parwatch.trainer` is accepted (see `parwatch train --help`);
    `--parwatch on` is implied.

    \b
    Example:
      parwatch train --nproc 4 --tp 2 --pp 2 --microbatches 8 --steps 100 \\
          --parwatch-endpoint http://127.0.0.1:9401 --parwatch-log runs/r1
    """
    args = list(ctx.args)
    if "-h" in args or "--help" in args:
        # The trainer's argparse prints its own usage and exits 0; say first how this
        # wrapper differs from `python -m parwatch.trainer`, with an example.
        click.echo(HELP_HEADER)
    from parwatch.collector.attach import RankAttach
    from parwatch.collector.evidence import enable_flight_recorder
    from parwatch.trainer.launch import main

    # Before any process group exists (the ranks inherit it): a hang's evidence includes torch's Flight
    # Recorder dump, which records only with a buffer size set (the user's own setting wins).
    enable_flight_recorder()

    if "--parwatch" not in args:
        args = ["--parwatch", "on", *args]
    sys.exit(main(args, attach=RankAttach()))
