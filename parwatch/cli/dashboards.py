"""`parwatch dashboards`: write the Grafana dashboard to a file, or push it to a Grafana."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

import click

from parwatch import dashboards as dash
from parwatch import recording
from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR

TOKEN_ENV = "GRAFANA_TOKEN"


@click.group(
    epilog="""\b
Examples:
  parwatch dashboards export -o dashboards/parwatch.json
  parwatch dashboards recording-rules -o dashboards/recording_rules.yaml
  GRAFANA_TOKEN=glsa_... parwatch dashboards push --url http://grafana:3000
"""
)
def dashboards():
    """The Grafana dashboard (Prometheus datasource chosen by a dashboard variable)."""


@dashboards.command(epilog="\b\nExample:\n  parwatch dashboards export -o dashboards/parwatch.json")
@click.option("-o", "--output", default="-", show_default=True, help="File to write; '-' is stdout.")
@click.option(
    "--price-per-gpu-hour",
    type=float,
    default=DEFAULT_PRICE_PER_GPU_HOUR,
    show_default=True,
    help="Default of the dashboard's price variable (idle-cost panels).",
)
@click.option(
    "--rate-window",
    default=recording.RATE_WINDOW,
    show_default=True,
    help="The window the recording rules were rendered with (the panels read their names).",
)
def export(output, price_per_gpu_hour, rate_window):
    """Write the dashboard JSON (what Grafana's file or sidecar provisioning loads)."""
    try:
        board = dash.build_dashboard(price_per_gpu_hour, rate_window=recording.checked_window(rate_window))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--rate-window") from err
    text = dash.dashboard_json(board)
    _write(output, text)


@dashboards.command(
    "recording-rules",
    epilog="""\b
Example:
  parwatch dashboards recording-rules -o dashboards/recording_rules.yaml
  parwatch rules render-alerts -o dashboards/alerts.yaml    # same --rate-window
  promtool check rules dashboards/recording_rules.yaml dashboards/alerts.yaml
""",
)
@click.option("-o", "--output", default="-", show_default=True, help="File to write; '-' is stdout.")
@click.option(
    "--rate-window",
    default=recording.RATE_WINDOW,
    show_default=True,
    help="Range of rate() in recorded rates and means; render the alerts with the same window.",
)
def recording_rules(output, rate_window):
    """Write the recording rules the dashboard and the alerts read (Prometheus or vmalert rules file)."""
    try:
        text = recording.render_recording_rules_yaml(rate_window)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--rate-window") from err
    _write(output, text)


def _write(output: str, text: str) -> None:
    """`text` to stdout ('-') or to the file `output`, its directory made."""
    if output == "-":
        sys.stdout.write(text)
        return
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text)
    click.echo(f"wrote {output}", err=True)


def _token(token_file: str | None, url: str) -> str | None:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise click.BadParameter(f"cannot read it ({err.strerror})", param_hint="--token-file") from err
        if not token:
            raise click.BadParameter(
                f"{token_file} is empty; write the Grafana service-account token into it", param_hint="--token-file"
            )
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    if urlparse(url).password:
        return None  # basic auth from the URL
    raise click.UsageError(
        f"no Grafana credentials: pass --token-file FILE, set {TOKEN_ENV}, or put user:password@ in --url"
    )


@dashboards.command(
    epilog="""\b
Example:
  parwatch dashboards push --url http://grafana:3000 --token-file /etc/parwatch/grafana-token
"""
)
@click.option("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
@click.option(
    "--token-file", type=click.Path(dir_okay=False), help=f"File holding a Grafana token (else ${TOKEN_ENV})."
)
@click.option(
    "--folder-uid", default=dash.DEFAULT_FOLDER_UID, show_default=True, help="Folder to put it in (created if missing)."
)
@click.option("--folder-title", default="parwatch", show_default=True, help="Title when the folder is created.")
@click.option("--price-per-gpu-hour", type=float, default=DEFAULT_PRICE_PER_GPU_HOUR, show_default=True)
@click.pass_context
def push(ctx, url, token_file, folder_uid, folder_title, price_per_gpu_hour):
    """Create or overwrite the dashboard through Grafana's HTTP API."""
    # Tests inject a fake GrafanaApi factory through ctx.obj; Grafana cannot run on CI machines.
    connect = (ctx.obj or {}).get("grafana_connect", dash.connect)
    api = connect(url, _token(token_file, url))
    answer = dash.push_dashboard(api, dash.build_dashboard(price_per_gpu_hour), folder_uid, folder_title)
    where = answer.get("url", "") if isinstance(answer, dict) else ""
    click.echo(f"pushed dashboard {dash.DASHBOARD_UID} to folder {folder_uid} {where}".rstrip())
