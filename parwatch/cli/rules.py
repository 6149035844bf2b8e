"""`parwatch rules`: validate guardrail rules files and render Prometheus alert rules from them."""

from __future__ import annotations

import sys

import click

from parwatch.guardrails.alerts import (
    DEFAULT_RATE_WINDOW,
    DEFAULT_RUNBOOK,
    DEFAULT_STEP_SECONDS,
    render_alert_rules_yaml,
)
from parwatch.guardrails.rules import RulesError, RuleSet, default_rules, load_rules


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def rules():
    """Validate guardrail rules files and render Prometheus alert rules from them.

    \b
    Example:
      parwatch rules check rules.yaml
      parwatch rules render-alerts rules.yaml -o alerts.yaml --step-seconds 2.5
    """


@rules.command(
    "check",
    epilog="""\b
Example:
  $ parwatch rules check rules.yaml
  ok: 7 rules (enforce=true)
  $ parwatch rules check broken.yaml
  broken.yaml:12: rule 'bubble-excess': field 'abov': unknown field in a rule; did you mean 'above'?
""",
)
@click.argument("file", type=click.Path(dir_okay=False))
def check(file):
    """Validate a rules FILE: print every problem with its line, exit 1 if there is any."""
    ruleset = _load(file)
    click.echo(f"ok: {len(ruleset.rules)} rules (enforce={str(ruleset.enforce).lower()})")


@rules.command(
    "render-alerts",
    epilog="""\b
Example:
  parwatch rules render-alerts                        # the packaged default rules, to stdout
  parwatch rules render-alerts rules.yaml -o alerts.yaml --step-seconds 2.5
  promtool check rules alerts.yaml
""",
)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@click.option(
    "--step-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_STEP_SECONDS,
    show_default=True,
    help="Assumed training step period: turns for_steps and window_steps into time.",
)
@click.option(
    "--rate-window",
    default=DEFAULT_RATE_WINDOW,
    show_default=True,
    help="Range of the rate() behind histogram means (step_seconds, collective_seconds_mean).",
)
@click.option(
    "--runbook-base", default=DEFAULT_RUNBOOK, show_default=True, help="runbook_url is this plus '#<rule name>'."
)
def render_alerts(file, out, step_seconds, rate_window, runbook_base):
    """Render Prometheus alert rules from a rules FILE (default: the packaged default rules)."""
    ruleset = _load(file) if file else default_rules()
    text = render_alert_rules_yaml(ruleset, runbook_base, step_seconds, rate_window)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        click.echo(f"wrote {len(ruleset.rules)} rules' alerts to {out}", err=True)
    else:
        click.echo(text, nl=False)


def _load(file: str) -> RuleSet:
    """The rules FILE, or exit 1 after printing every problem with its line."""
    try:
        return load_rules(file)
    except RulesError as e:
        for problem in e.problems:
            click.echo(str(problem), err=True)
        sys.exit(1)
