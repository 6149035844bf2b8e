"""`parwatch demo`: the main job, with embedded defaults."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from parwatch.demo.scenario import SCENARIOS, DemoConfig


def _interrupt_on(signum, frame):
    # SIGTERM (timeout, CI cancelling a job, kill) and SIGHUP (terminal closed) must run the
    # runner's cleanup as Ctrl-C does: the default action would end this process at once and
    # leave the sidecar and the trainer, which run in their own sessions, behind.
    raise KeyboardInterrupt(signum)


@click.command(
    epilog="""\b
Examples:
  parwatch demo                          # 40 steps, TP2 x PP2, no fault
  parwatch demo --scenario nan           # NaN loss mid-run: rollback, run completes
  parwatch demo --scenario straggler --steps 60 --run-dir runs/straggler
"""
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=DemoConfig.steps,
    show_default=True,
    help="Optimizer steps to complete.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where summaries, decisions, checkpoints and the report go (default runs/demo-TIMESTAMP).",
)
@click.option(
    "--scenario",
    type=click.Choice(SCENARIOS),
    default="none",
    show_default=True,
    help="Fault injected mid-run so a guardrail acts.",
)
@click.option("--microbatches", type=click.IntRange(min=1), default=DemoConfig.microbatches, show_default=True)
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default=DemoConfig.schedule, show_default=True)
@click.option(
    "--price-per-gpu-hour",
    type=float,
    default=DemoConfig.price_per_gpu_hour,
    show_default=True,
    help="Prices idle accelerator time in the summary.",
)
def demo(steps, run_dir, scenario, microbatches, schedule, price_per_gpu_hour):
    """Start a sidecar and a TP2 x PP2 trainer (gloo, no GPU needed) on this machine, watch
    the run live, and end with measured vs theoretical bubble, collective latency,
    decisions, and a report with a pipeline timeline."""
    from rich.console import Console

    from parwatch.demo.runner import DemoFailed, run_demo

    console = Console()
    cfg = DemoConfig(
        steps=steps,
        scenario=scenario,
        microbatches=microbatches,
        schedule=schedule,
        price_per_gpu_hour=price_per_gpu_hour,
    )
    path = Path(run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:  # nohup's choice stands
            signal.signal(sig, _interrupt_on)
    try:
        run_demo(cfg, path, console, interactive=console.is_terminal)
    except KeyboardInterrupt as stop:
        signum = stop.args[0] if stop.args and isinstance(stop.args[0], int) else signal.SIGINT
        console.print(
            f"interrupted: every process the demo started is stopped; what was recorded is in {path}", highlight=False
        )
        sys.exit(128 + signum)
    except (DemoFailed, RuntimeError) as err:
        raise click.ClickException(str(err)) from None
