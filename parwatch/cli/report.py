"""`parwatch report RUN_DIR`: pictures, a Perfetto trace and a one-page summary of a run."""

from __future__ import annotations

import sys

import click

from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR


@click.command(
    epilog="""\b
Examples:
  parwatch report runs/demo                  # writes runs/demo/report/index.html and friends
  parwatch report runs/demo --step 40        # draw the timeline of step 40
  parwatch report runs/demo --out /tmp/rep --price-per-gpu-hour 3.5
  parwatch report runs/pp --decisions parwatch-state/decisions.jsonl   # the sidecar's decisions
"""
)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--step",
    type=int,
    default=None,
    help="Step to draw in the timeline (default: the last sampled step with spans from every stage).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output directory (default: RUN_DIR/report).",
)
@click.option(
    "--price-per-gpu-hour",
    type=click.FloatRange(min=0),
    default=DEFAULT_PRICE_PER_GPU_HOUR,
    show_default=True,
    help="USD per accelerator-hour, for the idle-cost lines.",
)
@click.option(
    "--decisions",
    "decisions_path",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="The sidecar's decisions.jsonl (its --state-dir), read for this run's records when RUN_DIR has none.",
)
def report(run_dir, step, out_dir, price_per_gpu_hour, decisions_path):
    """Write timeline.png/.svg, trace.json, bubble/loss/collectives plots and index.html for RUN_DIR."""
    from parwatch.report.build import ReportOptions, StepNotSampled, build_report
    from parwatch.report.loader import RunDirNotFound

    try:
        written = build_report(
            run_dir,
            step=step,
            out_dir=out_dir,
            options=ReportOptions(price_per_gpu_hour=price_per_gpu_hour, decisions_path=decisions_path),
        )
    except (RunDirNotFound, StepNotSampled) as e:
        click.echo(f"parwatch report: {e}", err=True)
        sys.exit(1)
    for name, path in written.items():
        click.echo(f"{name:13s} {path}")
    if "timeline_png" not in written:
        click.echo("no timeline drawn: see Notes in index.html for why")
