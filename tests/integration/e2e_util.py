"""Shared pieces of the end-to-end tests: the real trainer (`python -m parwatch.trainer --nproc N`) in its
own process group, talking to a real `parwatch sidecar` (tests/sidecar_process.py, running_sidecar).

Every wait has a deadline and every trainer is killed (its whole process group) when a test
leaves, so a hang fails the test instead of holding the machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from tests import one_client
from tests.deadline import WAIT_S, DeadlineExceeded, wait_until  # noqa: F401 (the e2e tests wait with these)

ROOT = Path(__file__).resolve().parents[2]
TRAINER_TIMEOUT_S = 180.0
"""Hard limit on one trainer run (the launcher, its ranks and their collectives)."""

SMALL_MODEL = ("--layers", "2", "--hidden", "32", "--seq-len", "16")
"""A real-compute model small enough for steps of a few tens of milliseconds on one core."""


def synthetic(fwd_ms: float, bwd_ms: float, serial_tp: bool = False) -> tuple[str, ...]:
    """Timed sleeps instead of layer math: step times that do not depend on the machine's load. serial_tp: the
    TP collectives on the critical path, as real TP layers' are (a rank waiting for a late TP peer computes no
    less for it): what judging a slow link beside TP needs (parwatch/trainer/synthetic.py)."""
    return ("--synthetic-compute", f"fwd_ms={fwd_ms:g},bwd_ms={bwd_ms:g}" + (",serial_tp=1" if serial_tp else ""))


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of `path` ([] when it does not exist yet; a half-written last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def decision_records(state_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(Path(state_dir) / "decisions.jsonl") if r.get("type") == "decision"]


def applied_records(state_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(Path(state_dir) / "decisions.jsonl") if r.get("type") == "applied"]


def is_finite_loss(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class TrainerRun:
    """One `python -m parwatch.trainer` launcher process and the files of its run."""

    proc: subprocess.Popen
    run_dir: Path
    steps: int

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "ckpt"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    def output(self) -> str:
        path = self.run_dir / "trainer.out"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def hang_blocked_at(self) -> float | None:
        """The wall time an injected hang blocked its rank (parwatch.trainer.faults logs it), None before it did."""
        return self._logged_time(r"injected hang \(\w+\) at step \d+, blocking at ([0-9.]+)")

    def fault_at(self) -> float | None:
        """The wall time an injected crash or exception ended its rank (the trainer logs it), None before."""
        return self._logged_time(r"injected (?:crash|exception) at step \d+, (?:exiting|raising) at ([0-9.]+)")

    def _logged_time(self, pattern: str) -> float | None:
        path = self.run_dir / "trainer.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        match = re.search(pattern, text)
        return float(match.group(1)) if match else None

    def ledger(self, rank: int) -> dict:
        """The rank's goodput ledger (ledger-rank<N>.json, written at its collector's close), checked
        to partition the rank's wall time: the categories sum to its process's lifetime (1%)."""
        ledger = json.loads((self.log_dir / f"ledger-rank{rank}.json").read_text())
        lifetime = ledger["end_time"] - ledger["process_start_time"]
        assert lifetime > 0 and sum(ledger["time_seconds"].values()) == pytest.approx(lifetime, rel=0.01), ledger
        assert ledger["wall_seconds"] == pytest.approx(lifetime, rel=0.01)
        return ledger

    def summaries(self, rank: int | None = None) -> list[dict]:
        """Step summaries the collectors wrote (--parwatch-log), of one rank or all."""
        rows = read_jsonl(self.log_dir / "summaries.jsonl")
        return [r for r in rows if rank is None or r["rank"] == rank]

    def wait(self, timeout: float = TRAINER_TIMEOUT_S) -> dict:
        """Wait for the launcher to exit 0 and return rank 0's summary.json."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise DeadlineExceeded(f"trainer did not finish in {timeout:g} s\n{self.output()}") from None
        assert code == 0, f"trainer exited with {code}\n{self.output()}"
        return json.loads(self.summary_path.read_text())


def token_args(sidecar) -> tuple[str, ...]:
    """The trainer flag that hands it the sidecar's token (sidecars authenticate writes by default)."""
    return ("--parwatch-token-file", str(sidecar.token_file))


def trainer_command(
    endpoint: str | None, run_dir: Path, steps: int, *extra: str, nproc: int = 2, checkpoint_every: int = 0
) -> list[str]:
    run_dir = Path(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "parwatch",
        "train",
        "--nproc",
        str(nproc),
        "--steps",
        str(steps),
        "--parwatch",
        "on",
        "--parwatch-log",
        str(run_dir / "log"),
        "--summary-json",
        str(run_dir / "summary.json"),
    ]
    if endpoint:
        cmd += ["--parwatch-endpoint", endpoint]
    if checkpoint_every:
        cmd += ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", str(checkpoint_every)]
    return cmd + list(extra)


@contextlib.contextmanager
def running_trainer(
    endpoint: str | None, run_dir: Path, steps: int, *extra: str, nproc: int = 2, checkpoint_every: int = 0
):
    """Start the trainer in its own process group; yield a TrainerRun; kill the group on the way out."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = trainer_command(endpoint, run_dir, steps, *extra, nproc=nproc, checkpoint_every=checkpoint_every)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(run_dir / "trainer.out", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield TrainerRun(proc, run_dir, steps)
    finally:
        kill_group(proc)


TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


def launch_nodes(
    out_paths: list[Path],
    node_args: list[list[str]],
    envs: list[dict],
    nproc_per_node: int = 2,
) -> list[subprocess.Popen]:
    """Several "nodes" of one run on this machine: a `torchrun --nnodes N --node-rank K` launcher per
    entry (static rendezvous on loopback) running `-m parwatch train` with that node's args, environment and
    output file. Each in its own process group (kill_group). Returns once node 0's launcher listens on the
    rendezvous port: a port free a moment ago can be taken before torchrun binds it (EADDRINUSE; the fault
    campaign's torchrun in CI on d94243b), and the run is then launched again on another."""
    from tests.sidecar_process import free_port, listens

    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        port, said_before = free_port(), Path(out_paths[0]).stat().st_size if attempt > 1 else 0
        procs = [
            _launch_node(k, len(node_args), port, nproc_per_node, *node, append=attempt > 1)
            for k, node in enumerate(zip(out_paths, node_args, envs))
        ]
        wait_until(partial(_store_up_or_ended, procs[0], port), "node 0's rendezvous store", 60)
        if listens(procs[0].pid, port) or attempt == RENDEZVOUS_TRIES:
            return procs
        if b"already in use" not in Path(out_paths[0]).read_bytes()[said_before:]:
            return procs  # ended for another reason: wait_nodes tells it
        for proc in procs:
            kill_group(proc)
    raise AssertionError("unreachable")


RENDEZVOUS_TRIES = 3


def _store_up_or_ended(launcher: subprocess.Popen, port: int) -> bool:
    from tests.sidecar_process import listens

    return listens(launcher.pid, port) or launcher.poll() is not None


def _launch_node(
    k: int, nnodes: int, port: int, nproc: int, out_path: Path, args: list[str], env: dict, append: bool
) -> subprocess.Popen:
    """One node's launcher; `append`: after an earlier launch's output (it says why it was launched again)."""
    cmd = [TORCHRUN, "--nnodes", str(nnodes), "--node-rank", str(k), "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "parwatch", "train", *args]
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(out_path, "ab" if append else "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def rendezvous_port_taken_once(monkeypatch):
    """launch_nodes' first port (tests.sidecar_process.free_port's next answer) is one another socket listens
    on, then free ones as before; yields the ports it handed out."""
    import socket

    import tests.sidecar_process

    picked: list[int] = []
    real_free_port = tests.sidecar_process.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def taken_first(host: str = "127.0.0.1") -> int:
            picked.append(taken.getsockname()[1] if not picked else real_free_port(host))
            return picked[-1]

        monkeypatch.setattr(tests.sidecar_process, "free_port", taken_first)
        yield picked


def wait_nodes(procs: list[subprocess.Popen], out_paths: list[Path], timeout: float = TRAINER_TIMEOUT_S) -> None:
    """Wait for every launcher of launch_nodes to exit 0 (AssertionError with its output otherwise,
    DeadlineExceeded past the timeout)."""
    deadline = time.monotonic() + timeout
    for k, (proc, out_path) in enumerate(zip(procs, out_paths)):
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            code = "timeout"
        out = Path(out_path).read_text(errors="replace")[-3000:]
        if code == "timeout":
            raise DeadlineExceeded(f"node {k}'s launcher ({out_path}) did not finish in {timeout:g} s\n{out}")
        assert code == 0, f"node {k}'s launcher ({out_path}) exited with {code}\n{out}"


def run_on_hosts(
    endpoint: str, run_dir: Path, steps: int, hosts: tuple[str, ...], *extra: str, nproc_per_host: int = 2
) -> None:
    """One run on several "hosts" of this machine (launch_nodes), each with $PARWATCH_HOST set to its
    name, all shipping to `endpoint`. Host k holds ranks k*nproc_per_host ... (k+1)*nproc_per_host - 1.
    Waits for every launcher to exit 0."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    outs = [run_dir / f"{host}.out" for host in hosts]
    args = [
        [
            "--steps",
            str(steps),
            "--parwatch",
            "on",
            "--parwatch-endpoint",
            endpoint,
            "--parwatch-log",
            str(run_dir / f"log-{host}"),
            "--summary-json",
            str(run_dir / "summary.json"),
            *extra,
        ]
        for host in hosts
    ]
    envs = [dict(os.environ, TRAINER_THREADS="1", PARWATCH_HOST=host) for host in hosts]
    procs = launch_nodes(outs, args, envs, nproc_per_host)
    try:
        wait_nodes(procs, outs)
    finally:
        for proc in procs:
            kill_group(proc)


def run_trainer(endpoint: str | None, run_dir: Path, steps: int, *extra: str, **kw) -> tuple[TrainerRun, dict]:
    """Run the trainer to completion; (the run, rank 0's summary.json)."""
    with running_trainer(endpoint, run_dir, steps, *extra, **kw) as run:
        return run, run.wait()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc): torchrun's workers run in sessions of their own,
    which a signal to the launcher's process group does not reach."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, frontier = [], [pid]
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, ())]
        out += nxt
        frontier = nxt
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a node's launcher and all its workers)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def kill_group(proc: subprocess.Popen) -> None:
    """Stop the launcher and its rank processes (its group and every descendant), if still there."""
    if proc.poll() is None:
        below = descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        proc.wait(10)
    elif proc.returncode != 0:  # the launcher failed; ranks it left behind still carry its group id
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


class Control:
    """The sidecar's control listener, with the token the test holds (None: no token)."""

    def __init__(self, url: str, token: str | None = None):
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def status(self) -> dict:
        r = one_client.get(f"{self.url}/v1/status", headers=self.headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()


def metric_value(metrics_url: str, name: str) -> float | None:
    """The value of an unlabelled series on /metrics (None when absent)."""
    text = one_client.get(f"{metrics_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
