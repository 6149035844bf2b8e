"""Start `parwatch sidecar` as a child process and wait until it answers (tests, benchmarks).

The context manager always stops the child (SIGTERM, then SIGKILL), even when the body fails.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from parwatch.demo.processes import wait_healthy
from parwatch.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class SidecarProcess:
    proc: subprocess.Popen
    metrics_url: str
    control_url: str
    log_path: Path
    token: str = ""
    """The bearer token the control listener requires (the one given, or the one it generated)."""
    token_file: Path | None = None
    """A file holding `token` (mode 0600): hand it to trainers (--parwatch-token-file) and the CLI."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        return self.proc.pid


def sidecar_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "parwatch.cli.main", "sidecar", *args]


def _limit_files(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


PORT_ATTEMPTS = 3


@contextlib.contextmanager
def running_sidecar(
    state_dir: Path,
    *extra: str,
    token: str | None = None,
    timeout: float = 60.0,
    env=None,
    open_files: int | None = None,
    root: Path = ROOT,
):
    """Yield a SidecarProcess on free loopback ports; its stderr goes to state_dir/../sidecar-<port>.log.
    root: the source tree whose parwatch runs it (a benchmark's baseline: another checkout).

    token None (and no --token-file in extra): the sidecar generates STATE_DIR/token, as it does by
    default; either way the SidecarProcess carries the token and a file holding it. open_files: the
    child's soft and hard limit on open files (`ulimit -n`), as a host might set it."""
    state_dir = Path(state_dir)
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), child_env.get("PYTHONPATH")]))
    if token is not None:
        child_env["PARWATCH_TOKEN"] = token
    else:
        child_env.pop("PARWATCH_TOKEN", None)  # the sidecar's default: its own generated token
    for attempt in range(PORT_ATTEMPTS):
        # free_port() only finds a port free now: another process (a rank's rendezvous, gloo) may take
        # it before the sidecar binds. The sidecar then says so and exits: take other ports.
        metrics, control = free_port(), free_port()
        log_path = state_dir.parent / f"sidecar-{control}.log"
        args = [
            "--state-dir",
            str(state_dir),
            "--metrics-listen",
            f"127.0.0.1:{metrics}",
            "--control-listen",
            f"127.0.0.1:{control}",
            *extra,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                sidecar_command(*args),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                preexec_fn=None if open_files is None else partial(_limit_files, open_files),
            )
        sp = SidecarProcess(proc, f"http://127.0.0.1:{metrics}", f"http://127.0.0.1:{control}", log_path)
        try:
            wait_healthy(f"{sp.control_url}/healthz", proc, timeout)
            break
        except (RuntimeError, TimeoutError) as err:
            stop(proc)
            if "already in use" in sp.log() and attempt + 1 < PORT_ATTEMPTS:
                continue
            raise RuntimeError(f"{err}\n--- sidecar log ---\n{sp.log()}") from None
    try:
        sp.token_file = Path(extra[extra.index("--token-file") + 1]) if "--token-file" in extra else None
        if token is not None:
            sp.token_file = state_dir.parent / f"token-{control}"
            fd = os.open(sp.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
        sp.token_file = sp.token_file or state_dir / "token"
        sp.token = sp.token_file.read_text().strip()
        yield sp
    finally:
        stop(proc)


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a listening TCP socket on `port` (/proc/net/tcp's and tcp6's inodes: the
    sidecar listens on 127.0.0.1, torchrun's rendezvous store on ::, dual-stack)."""
    try:
        rows = [line.split() for f in ("tcp", "tcp6") for line in Path(f"/proc/net/{f}").read_text().splitlines()[1:]]
        inodes = {f"socket:[{r[9]}]" for r in rows if r[3] == "0A" and int(r[1].rpartition(":")[2], 16) == port}
        fds = Path(f"/proc/{pid}/fd")
        return any(os.readlink(fd) in inodes for fd in fds.iterdir())
    except OSError:
        return False
