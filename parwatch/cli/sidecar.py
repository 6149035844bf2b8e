"""`parwatch sidecar`: run the metrics + control listeners next to a training run."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from parwatch.sidecar.config import (
    DEFAULT_CONTROL_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_RANKS,
    DEFAULT_MAX_RUNS,
    DEFAULT_METRICS_LISTEN,
    ConfigError,
    SidecarConfig,
    parse_listen,
)
from parwatch.sidecar.trackers.spec import DEFAULT_EVERY_STEPS
from parwatch.tokens import TokenError, read_token

_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROL.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029)})  # line separators to some log readers
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def escape_controls(text: str) -> str:
    """Control characters as visible escapes: a run id (or any client text) cannot forge log lines."""
    return text.translate(_CONTROL)


class EscapingFormatter(logging.Formatter):
    """One record, one line: the message's control characters are escaped (tracebacks keep theirs)."""

    def formatMessage(self, record):
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


EPILOG = """\b
Examples:
  parwatch sidecar
  parwatch sidecar --rules rules.yaml --state-dir /var/lib/parwatch
  parwatch sidecar --metrics-listen 0.0.0.0:9400 --control-listen 0.0.0.0:9401 --token-file /run/secrets/parwatch
  PARWATCH_TOKEN=s3cret parwatch sidecar --control-listen 10.0.0.5:9401 --rank-grace-seconds 60
  parwatch sidecar --export tensorboard:./tb --export wandb --export-every 20
  srun --overlap --ntasks-per-node=1 parwatch sidecar --token-file "$RUN_DIR/token" --hang-requeue   # Slurm
\b
Signals: SIGHUP reloads --rules (an invalid file keeps the old rules and is logged);
SIGTERM or Ctrl-C stops. Decisions and guardrail state survive restarts in --state-dir.
"""


@click.command(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--rules",
    "rules",
    type=click.Path(dir_okay=False),
    default=None,
    help="Guardrail rules YAML (default: the packaged rules). e.g. --rules rules.yaml",
)
@click.option(
    "--state-dir",
    default="./parwatch-state",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Engine state and decisions.jsonl; the only place the sidecar writes. e.g. --state-dir /var/lib/parwatch",
)
@click.option(
    "--metrics-listen",
    default=DEFAULT_METRICS_LISTEN,
    show_default=True,
    metavar="HOST:PORT",
    help="HOST:PORT for the read-only GET /metrics and /healthz. e.g. --metrics-listen 0.0.0.0:9400",
)
@click.option(
    "--control-listen",
    default=DEFAULT_CONTROL_LISTEN,
    show_default=True,
    metavar="HOST:PORT",
    help="HOST:PORT for ingest, control, alerts and status; non-loopback needs a token. "
    "e.g. --control-listen 127.0.0.1:9401",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File (mode 0600) holding the bearer token ingest, control, alerts, status and decisions "
    "require (else env PARWATCH_TOKEN; else STATE_DIR/token, generated on first start). "
    "e.g. --token-file /run/secrets/parwatch-token",
)
@click.option(
    "--rank-grace-seconds",
    type=float,
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="A rank silent this long gets parwatch_rank_up 0; its other series vanish after twice this. "
    "e.g. --rank-grace-seconds 60",
)
@click.option(
    "--max-body-bytes",
    type=int,
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    metavar="BYTES",
    help="Larger request bodies are refused with 413. e.g. --max-body-bytes 1048576",
)
@click.option(
    "--body-timeout-seconds",
    type=float,
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="A request whose body has not arrived whole this long after its head is closed. "
    "e.g. --body-timeout-seconds 60",
)
@click.option(
    "--open-openapi/--no-open-openapi",
    default=False,
    show_default=True,
    help="Serve the control listener's /openapi.json without the token (by default it needs it).",
)
@click.option(
    "--max-ranks",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_RANKS,
    show_default=True,
    metavar="N",
    help="Ranks of the run this sidecar serves; summaries from more are refused (429). e.g. --max-ranks 64",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_RUNS,
    show_default=True,
    metavar="N",
    help="Run ids accepted within twice --rank-grace-seconds; more are refused (429). e.g. --max-runs 2",
)
@click.option(
    "--leader-url",
    default=None,
    metavar="URL",
    help="The run's leader sidecar (control listener) to forward this node's digest to; omit on the "
    "leader and on single-node runs. e.g. --leader-url http://parwatch-leader.ns.svc:9401",
)
@click.option(
    "--hang-min-seconds",
    type=float,
    default=SidecarConfig.hang_min_seconds,
    show_default=True,
    metavar="SECONDS",
    help="A hang needs at least this long without a step boundary. e.g. --hang-min-seconds 10",
)
@click.option(
    "--hang-step-factor",
    type=float,
    default=SidecarConfig.hang_step_factor,
    show_default=True,
    metavar="N",
    help="... and at least N median step times. e.g. --hang-step-factor 3",
)
@click.option(
    "--hang-busy-seconds",
    type=float,
    default=SidecarConfig.hang_busy_seconds,
    show_default=True,
    metavar="SECONDS",
    help="A rank in a checkpoint save, an eval pass or its first step is hung only past this long "
    "(and 20 median steps). e.g. --hang-busy-seconds 600",
)
@click.option(
    "--hang-dump-stacks/--no-hang-dump-stacks",
    default=False,
    show_default=True,
    help="On a hang, have the culprit write its Python stacks into the run directory (SIGUSR1).",
)
@click.option(
    "--hang-abort/--no-hang-abort",
    default=False,
    show_default=True,
    help="On a hang, make every rank exit with code 75 so the launcher restarts from a checkpoint.",
)
@click.option(
    "--export",
    "exports",
    multiple=True,
    metavar="TRACKER[:WHERE]",
    help="Also write the run's figures (step time, bubble per stage and its causes, goodput, MFU, collective p99, "
    "stragglers, hangs, decisions) to an experiment tracker, from the leader; repeatable. "
    "e.g. --export tensorboard:./tb --export mlflow:http://mlflow:5000 --export wandb:my-project "
    "(pip install 'parwatch[tensorboard]', '[mlflow]' or '[wandb]'; W&B runs offline without a key).",
)
@click.option(
    "--export-every",
    type=click.IntRange(min=1),
    default=DEFAULT_EVERY_STEPS,
    show_default=True,
    metavar="STEPS",
    help="Write to the --export trackers at most once per this many steps (and at the run's last). "
    "e.g. --export-every 50",
)
@click.option(
    "--hang-requeue/--no-hang-requeue",
    default=False,
    show_default=True,
    help="On a hang, requeue the Slurm job (scontrol requeue): it restarts under its job id and resumes from "
    "its newest verified checkpoint. Needs a Slurm job (SLURM_JOB_ID or --slurm-job-id).",
)
@click.option(
    "--slurm-job-id",
    envvar="SLURM_JOB_ID",
    show_envvar=True,
    default=None,
    metavar="ID",
    help="The Slurm job this sidecar runs in (srun sets SLURM_JOB_ID): what --hang-requeue and rules with "
    "action requeue requeue. e.g. --slurm-job-id 4242",
)
@click.option(
    "--max-requeues",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help="Requeue only while the job was restarted fewer than N times (SLURM_RESTART_COUNT); past that a "
    "requeue decision is an alert. e.g. --max-requeues 3",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="Log verbosity on stderr. e.g. --log-level debug",
)
def sidecar(
    rules,
    state_dir,
    metrics_listen,
    control_listen,
    token_file,
    rank_grace_seconds,
    max_body_bytes,
    body_timeout_seconds,
    open_openapi,
    max_ranks,
    max_runs,
    leader_url,
    hang_min_seconds,
    hang_step_factor,
    hang_busy_seconds,
    hang_dump_stacks,
    hang_abort,
    exports,
    export_every,
    hang_requeue,
    slurm_job_id,
    max_requeues,
    log_level,
):
    """Export Prometheus metrics for a run's ranks, evaluate guardrails, hand directives back."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    if log_level != "debug":  # a node's digest post every second would be an INFO line every second
        logging.getLogger("httpx").setLevel(logging.WARNING)
    from parwatch.guardrails.rules import RulesError
    from parwatch.sidecar.requeue import job_from_env
    from parwatch.sidecar.server import StartupError, serve
    from parwatch.sidecar.service import build_sidecar
    from parwatch.sidecar.state_dir import StateDirError, hold
    from parwatch.sidecar.trackers.spec import ExportError, parse_export

    try:
        config = SidecarConfig(
            rules_path=Path(rules) if rules else None,
            state_dir=Path(state_dir),
            metrics_listen=parse_listen(metrics_listen, "--metrics-listen"),
            control_listen=parse_listen(control_listen, "--control-listen"),
            token=read_token(token_file, private=True),
            token_file=Path(token_file) if token_file else None,
            rank_grace_seconds=rank_grace_seconds,
            max_body_bytes=max_body_bytes,
            body_timeout_seconds=body_timeout_seconds,
            open_openapi=open_openapi,
            leader_url=leader_url,
            hang_min_seconds=hang_min_seconds,
            hang_step_factor=hang_step_factor,
            hang_busy_seconds=hang_busy_seconds,
            hang_dump_stacks=hang_dump_stacks,
            hang_abort=hang_abort,
            hang_requeue=hang_requeue,
            slurm_job_id=slurm_job_id or None,
            slurm_restarts=job_from_env()[1],
            max_requeues=max_requeues,
            max_ranks=max_ranks,
            max_runs=max_runs,
            exports=tuple(parse_export(value) for value in exports),
            export_every_steps=export_every,
        )
        lock = hold(config.state_dir)  # before anything reads or writes it: one sidecar per state dir
        try:
            serve(build_sidecar(config))
        finally:
            lock.release()
    except (ConfigError, ExportError, TokenError, StartupError, StateDirError) as err:
        raise click.ClickException(str(err)) from None
    except RulesError as err:
        problems = "; ".join(str(p) for p in getattr(err, "problems", [])) or str(err)
        raise click.ClickException(f"invalid --rules file: {problems}") from None
    except OSError as err:
        raise click.ClickException(f"--state-dir {state_dir}: {err.strerror or err}") from None
