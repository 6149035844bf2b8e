"""Settings of one sidecar process, and the checks that relate them.

The same dataclass feeds `parwatch sidecar`, the app factory and the tests.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from parwatch.sidecar.hang import HangSettings
from parwatch.sidecar.requeue import JOB_ID
from parwatch.sidecar.trackers.spec import DEFAULT_EVERY_STEPS, ExportSpec
from parwatch.tokens import TOKEN_ENV, read_token

DEFAULT_METRICS_LISTEN = "127.0.0.1:9400"  # loopback unless told: Helm passes the pod network
DEFAULT_CONTROL_LISTEN = "127.0.0.1:9401"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
TOKEN_FILE_NAME = "token"
"""Without --token-file the sidecar writes a random token to STATE_DIR/token (mode 0600)."""
DEFAULT_MAX_RANKS = 4096
DEFAULT_MAX_RUNS = 4


class ConfigError(ValueError):
    """A setting is wrong; the message names the setting (flag) and the fix."""


@dataclass(frozen=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class SidecarConfig:
    rules_path: Path | None = None
    """Guardrail rules file (YAML); None means the packaged default rules."""
    state_dir: Path = Path("parwatch-state")
    """Where the engine keeps its state and decisions.jsonl: the only place the sidecar writes."""
    metrics_listen: Listen = Listen("127.0.0.1", 9400)
    """Read-only listener: GET /metrics and /healthz. May face the pod network."""
    control_listen: Listen = Listen("127.0.0.1", 9401)
    """Listener that changes a run (ingest, control, alerts). Loopback unless a token is set."""
    token: str | None = None
    """Bearer token the control listener requires; None: build_sidecar generates one in the state dir."""
    token_file: Path | None = None
    """Where the token came from (the generated STATE_DIR/token, or --token-file); for the log."""
    max_ranks: int = DEFAULT_MAX_RANKS
    """Ranks of the run this sidecar serves; more are refused (429)."""
    max_runs: int = DEFAULT_MAX_RUNS
    """Distinct run ids within 2x the grace period; more are refused (429)."""
    rank_grace_seconds: float = 30.0
    """A rank silent this long is reported down (parwatch_rank_up 0); its other series vanish after 2x."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Request bodies larger than this are refused with 413."""
    head_timeout_seconds: float = 10.0
    """A connection that has not sent its next request's head this long after connecting (or after its
    last answer) is closed: slow or idle connections cannot hold the listener's file descriptors."""
    body_timeout_seconds: float = 30.0
    """A request whose body has not arrived whole this long after its head is closed (8 MiB at 300 KB/s)."""
    open_openapi: bool = False
    """Serve /openapi.json without the token (it maps every route a caller may try; off by default)."""
    no_data_interval_seconds: float = 1.0
    """How often the engine is asked whether any rule's metric has gone silent."""
    leader_url: str | None = None
    """The run's leader sidecar (control listener URL) this node forwards its digest to; None: this
    sidecar is the leader or alone (it becomes leader on seeing rank 0)."""
    hang_min_seconds: float = HangSettings.min_seconds
    """A hang needs at least this long without a step boundary (and hang_step_factor median steps)."""
    hang_step_factor: float = HangSettings.step_factor
    """A hang needs at least this many median step times without a step boundary."""
    hang_busy_seconds: float = HangSettings.busy_seconds
    """A rank inside a checkpoint save, an eval pass or its first step is stalled only past this long (and
    20 median steps)."""
    hang_dump_stacks: bool = False
    """On a hang, signal the culprit (SIGUSR1) to write its Python stacks into the run directory."""
    hang_abort: bool = False
    """On a hang, make every rank exit with code 75 so the launcher or JobSet restarts from a checkpoint."""
    hang_requeue: bool = False
    """On a hang, requeue the Slurm job (`scontrol requeue`): it restarts under its job id and resumes from
    its newest verified checkpoint (parwatch/sidecar/requeue.py). Needs slurm_job_id."""
    slurm_job_id: str | None = None
    """The Slurm job the sidecar runs in (--slurm-job-id, else $SLURM_JOB_ID): what a requeue decision requeues."""
    slurm_restarts: int = 0
    """$SLURM_RESTART_COUNT when the sidecar started: the job's restarts so far, requeues included."""
    max_requeues: int = 1
    """A requeue decision is carried out while the job's restarts so far are fewer; past that it is an alert."""
    activity_silent_seconds: float = 5.0
    """A rank with no activity report for this long is silent (pid alive) or gone (pid ended)."""
    exports: tuple[ExportSpec, ...] = ()
    """Experiment trackers the leader writes the run's figures to (`--export`; parwatch/sidecar/trackers)."""
    export_every_steps: int = DEFAULT_EVERY_STEPS
    """A point to the trackers at most once per this many steps (and at the run's last step)."""

    def __post_init__(self):
        if self.export_every_steps < 1:
            raise ConfigError(f"--export-every must be >= 1 step (got {self.export_every_steps}); 10 suits most runs")
        kinds = [spec.tracker for spec in self.exports]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"--export names a tracker twice ({', '.join(map(str, self.exports))}); give each once")
        if self.leader_url is not None and not self.leader_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--leader-url {self.leader_url!r} must be an http(s) URL of the leader sidecar's "
                "control listener, e.g. --leader-url http://parwatch-leader.ns.svc:9401"
            )
        if not self.hang_min_seconds > 0 or not self.hang_step_factor >= 1:
            raise ConfigError(
                f"--hang-min-seconds must be > 0 and --hang-step-factor >= 1 (got "
                f"{self.hang_min_seconds}, {self.hang_step_factor}); the defaults "
                f"({HangSettings.min_seconds:g} and {HangSettings.step_factor:g}) suit most runs"
            )
        if not self.hang_busy_seconds >= self.hang_min_seconds:
            raise ConfigError(
                f"--hang-busy-seconds must be >= --hang-min-seconds (got {self.hang_busy_seconds}, "
                f"{self.hang_min_seconds}); 60 suits most runs"
            )
        if not self.activity_silent_seconds >= 2:
            raise ConfigError(
                f"--activity-silent-seconds must be >= 2 (got {self.activity_silent_seconds}): "
                "ranks report once a second"
            )
        if self.slurm_job_id is not None and not JOB_ID.match(self.slurm_job_id):
            raise ConfigError(f"--slurm-job-id {self.slurm_job_id!r} is not a Slurm job id (digits, e.g. 4242)")
        if self.hang_requeue and self.slurm_job_id is None:
            raise ConfigError(
                "--hang-requeue requeues the Slurm job the sidecar runs in: start it inside the job (srun sets "
                "SLURM_JOB_ID) or pass --slurm-job-id ID"
            )
        if self.max_requeues < 1:
            raise ConfigError(
                f"--max-requeues must be >= 1 (got {self.max_requeues}); without requeues, drop --hang-requeue"
            )
        if self.rank_grace_seconds <= 0:
            raise ConfigError(f"--rank-grace-seconds must be > 0 (got {self.rank_grace_seconds}); 30 suits most runs")
        if self.max_ranks < 1 or self.max_runs < 1:
            raise ConfigError(f"--max-ranks and --max-runs must be >= 1 (got {self.max_ranks}, {self.max_runs})")
        if not self.body_timeout_seconds > 0:
            raise ConfigError(
                f"--body-timeout-seconds must be > 0 (got {self.body_timeout_seconds}); 30 suits most runs"
            )
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024 (got {self.max_body_bytes}); the default is 8 MiB")
        if self.metrics_listen == self.control_listen:
            raise ConfigError(
                f"--metrics-listen and --control-listen are both {self.control_listen}; give them different ports"
            )
        if self.token is not None and not self.token.strip():
            raise ConfigError("the token is empty; put a non-empty secret in --token-file or PARWATCH_TOKEN")
        if not self.token and not is_loopback(self.control_listen.host):
            raise ConfigError(
                f"--control-listen {self.control_listen} is not a loopback address and no token is set; "
                f"set --token-file FILE or {TOKEN_ENV}, or listen on 127.0.0.1"
            )


def parse_listen(value: str, flag: str) -> Listen:
    """'HOST:PORT' (or '[v6]:PORT') -> Listen; errors name the flag."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag} {value!r} is not HOST:PORT; e.g. {flag} 127.0.0.1:9401")
    return Listen(host, int(port))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def ensure_token(state_dir: str | os.PathLike) -> tuple[str, Path, bool]:
    """(token, path, created): STATE_DIR/token, created with a random token (mode 0600) if absent.

    A restarted sidecar reuses the file, so trainers and operators holding it stay authorised."""
    path = Path(state_dir) / TOKEN_FILE_NAME
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _file_token(path, private=True), path, False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return _file_token(path), path, True


def _file_token(path: Path, private: bool = False) -> str:
    token = read_token(path, environ={}, private=private)
    assert token is not None  # a named file gives its token or raises TokenError, never None
    return token
