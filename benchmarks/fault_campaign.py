"""The fault campaign (issue 44): parwatch judged as a detector, over randomized faults and noisy healthy runs.

Every trial is a real run: gloo ranks, real `parwatch sidecar`s, one fault drawn at random (seeded: its
rank, stage, step, place and size) from the kinds below, on one of the setups that kind runs on:

    ref      the reference trainer, TP2 x PP2 on 4 ranks, one node, one sidecar (`parwatch train --nproc 4`)
    ref2     the same on two loopback nodes: `torchrun --nnodes 2 --node-rank K`, a sidecar per node, node 1's
             forwarding to node 0's (the leader)
    pipelining, megatron, deepspeed
             the torch.distributed.pipelining, Megatron-Core and DeepSpeed examples (PP2 under torchrun)

Healthy trials carry the noise real runs have, each well inside what must not alarm: checkpoint saves lasting
5 steps, eval passes lasting 10 steps, a first step 20 steps long, an operator pause of 30 s, 1.5 s stops of one
rank (SIGSTOP: a host hiccup), a CPU-hogging neighbour process throughout (or, on a host already busy, its own load).

Per fault kind: trials, detected, right finding kind, right culprit (rank, stage, place), right cause, latency
from the fault to the decision (p50, p99, max; steps for stragglers), and for hangs and crashes when every
reachable rank's evidence was kept. Per healthy configuration: steps run and every finding raised (false
positives per 10,000 steps). The machine's stolen CPU (/proc/stat) is recorded, as in the other benchmarks.

    python benchmarks/fault_campaign.py --trials 10 --healthy-steps 10000 --out benchmarks/results/fault_campaign.json
    python benchmarks/fault_campaign.py --quick         # one trial per kind, beside short healthy runs (the test suite's)
    python benchmarks/fault_campaign.py ... --resume    # after a stop: the trials its journal holds are not run again

Exit status 1 when a kind was missed or a healthy step raised a finding (--quick's check), else 0.
Goals (docs/benchmarks.md, "The fault campaign"): hang named median <= max(1.5 x median step, 3 s), p99 <=
max(2 x median step, 5 s), culprit right in every trial; crash told with rank and cause within 2 s; a node lost
named as its ranks gone; a 5% straggler named with rank and cause within 20 steps; <= 1 false straggler or link
finding per 10,000 healthy steps; no false hang, crash or action.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "integration")]

from common import cpu_jiffies, cpu_ticks, machine, percentile, print_table, stolen_share  # noqa: E402
from e2e_util import TORCHRUN, kill_group, kill_tree, launch_nodes, read_jsonl  # noqa: E402

from parwatch.contract import SpanKind  # noqa: E402
from parwatch.vocabulary import RankState  # noqa: E402
from tests.sidecar_process import free_port, sidecar_command, stop, wait_healthy  # noqa: E402

FWD_MS, BWD_MS, MICROBATCHES = 10.0, 20.0, 4
STEP_S = 0.2
"""The reference setups' nominal step (PP2 1F1B, m=4: 5 x (10 + 20) ms of compute and the transfers)."""
LONG_FWD_MS, LONG_BWD_MS = 25.0, 50.0
LONG_STEP_S = 0.45
"""The long-step healthy configuration's nominal step: its eval (10 steps) and checkpoint (5 steps) pauses
outlast the 2.75 s floor of the hang bound, so they are told apart only by what the ranks say they do."""
TOKEN = "fault-campaign-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


# ----------------------------------------------------------------------------------------- setups


class Sidecar:
    """A `parwatch sidecar` on fixed ports (a node of the run), its state dir and log beside the run."""

    def __init__(self, base: Path, name: str, *args: str):
        self.state_dir, self.log = base / f"{name}-state", base / f"{name}-sidecar.log"
        self.control_port, self.metrics_port = free_port(), free_port()
        self.args, self.proc = args, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def start(self) -> Sidecar:
        env = dict(os.environ, PARWATCH_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
        for _ in range(3):
            cmd = sidecar_command(
                "--state-dir",
                str(self.state_dir),
                "--control-listen",
                f"127.0.0.1:{self.control_port}",
                "--metrics-listen",
                f"127.0.0.1:{self.metrics_port}",
                *self.args,
            )
            logged = self.log.stat().st_size if self.log.exists() else 0
            with open(self.log, "ab") as log:
                self.proc = proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                wait_healthy(f"{self.url}/healthz", proc, 60)  # its own answer (pid), not another's on the port
                return self
            except RuntimeError as err:
                # It exited at once. A port free a moment ago may have been taken before it bound it (other
                # tests' servers and rendezvous share the host): try others. Anything else is no port race.
                with open(self.log, "rb") as f:
                    f.seek(logged)
                    said = f.read().decode(errors="replace")
                if "already in use" not in said:
                    raise RuntimeError(f"{err}; its log:\n{said[-2000:]}") from None
                self.control_port, self.metrics_port = free_port(), free_port()
        raise RuntimeError(f"{self.log.name}: the sidecar could not keep a port of its own in 3 tries")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped node must be able to exit
            stop(self.proc)

    def decisions(self) -> list[dict]:
        return [r for r in read_jsonl(self.state_dir / "decisions.jsonl") if r.get("type") == "decision"]

    def status(self) -> dict:
        try:
            return _http().get(f"{self.url}/v1/status", headers=HEADERS, timeout=5).json()
        except Exception:
            return {}

    def control(self, action: str, **body) -> None:
        _http().post(f"{self.url}/v1/control", json={"action": action, **body}, headers=HEADERS, timeout=10)


@functools.cache
def _http():
    """One keep-alive client for the campaign's polls (every 0.05-0.2 s): httpx.get() builds a client, and its
    TLS context, per call: ~24 ms of CPU each, against ~0.9 ms."""
    import httpx

    return httpx.Client(trust_env=False)


def _ref_args(steps: int, fwd: float = FWD_MS, bwd: float = BWD_MS) -> list[str]:
    return [
        "--tp",
        "2",
        "--pp",
        "2",
        "--schedule",
        "1f1b",
        "--microbatches",
        str(MICROBATCHES),
        "--steps",
        str(steps),
        "--synthetic-compute",
        f"fwd_ms={fwd:g},bwd_ms={bwd:g},serial_tp=1",  # TP on the critical path, as real TP layers' is
        "--pause-poll-s",
        "0.2",
        "--timeout-s",
        "120",
    ]


@dataclass
class Run:
    """A started setup: its sidecars (the leader first), launcher processes, the output files."""

    setup: str
    base: Path
    sidecars: list
    procs: list
    outs: list
    framework: bool = False
    start: str | None = None
    """How its start went (start_state): started, port-taken, ended, or slow (not past step 2 in 120 s)."""

    @property
    def leader(self) -> Sidecar:
        return self.sidecars[0]

    def output(self) -> str:
        return "".join(Path(o).read_text(errors="replace") for o in self.outs if Path(o).exists())

    def logged_time(self, what: str) -> float | None:
        """The wall time a fault logged (`injected hang ... blocking at T`, crash, exception)."""
        import re

        m = re.search(rf"injected {what}\b[^\n]*? at ([0-9]+\.[0-9]+)", self.output())
        return float(m.group(1)) if m else None

    def ended(self) -> bool:
        """Every rank (or launcher) process has exited."""
        return all(p.poll() is not None for p in self.procs)

    def last_step(self) -> int:
        return self.leader.status().get("last_step") or 0

    def start_state(self) -> str | None:
        """started (past step 2), port-taken (a process that bound its rendezvous port exited: not free), ended,
        or None (not yet). Two nodes' output can say so of a launch that launch_nodes has already redone."""
        if self.last_step() >= 2:
            return "started"
        exited = any(p.poll() is not None for p in self.procs)
        if exited and "address already in use" in self.output():
            return "port-taken"
        return "ended" if self.ended() else None

    def rank_pid(self, rank: int) -> int | None:
        """The rank's process: a forked rank's own, or a torchrun worker's (its RANK)."""
        if self.setup == "ref":
            return self.procs[rank].pid
        for proc in self.procs:
            pids = _children(proc.pid)
            with_rank = {r: p for p in pids if (r := _env_rank(p)) is not None}
            if with_rank:
                if rank in with_rank:
                    return with_rank[rank]
                continue
            workers = [p for p in pids if b"resource_tracker" not in _cmdline(p)]
            if len(workers) > rank:
                return sorted(workers, key=_start_time)[rank]
        return None

    def stop(self) -> None:
        for p in self.procs:
            if isinstance(p, _Forked):
                p.kill()
                continue
            kill_group(p)
            with contextlib.suppress(Exception):
                kill_tree(p.pid)
        for s in self.sidecars:
            s.stop()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
    return out


def _env_rank(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"RANK="):
                return int(item[5:])
    return None


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def _start_time(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return 0


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "parwatch.trainer.train", "parwatch.collector.attach"]
"""What the one-node setup's fork server imports once: its ranks then start in a fraction of a second, not
the seconds four fresh interpreters importing torch take on two cores (tests/distutil.py does the same)."""


def _rank_main(argv: list[str], rank: int, world: int, port: int, out: str) -> None:
    """One rank of the one-node setup: what `parwatch train --nproc 4`'s spawned rank runs (the trainer and
    the collector attached by parwatch's own attach), forked from the campaign's fork server."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.update(PARWATCH_TOKEN=TOKEN, TRAINER_THREADS="1")
    import logging

    from parwatch.collector.attach import attach_from_config
    from parwatch.collector.evidence import enable_flight_recorder
    from parwatch.trainer.config import parse_args
    from parwatch.trainer.launch import run_rank

    logging.basicConfig(level="WARNING", format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s", force=True)
    enable_flight_recorder()
    code = 0
    try:
        run_rank(parse_args(argv), rank, world, local_rank=rank, attach=attach_from_config)
    except BaseException as exc:  # as the spawn launcher's rank: the error on stderr, a non-zero exit
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


class _Forked:
    """A forked rank as a Popen-like handle (pid, poll)."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    def poll(self):
        return self.process.exitcode

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)


_FORKSERVER = None
_FORKSERVER_LOCK = threading.Lock()


def _forkserver():
    global _FORKSERVER
    with _FORKSERVER_LOCK:
        if _FORKSERVER is None:
            import multiprocessing as mp

            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _FORKSERVER = ctx
        return _FORKSERVER


START_TRIES = 3


def start_run(setup: str, base: Path, extra: list[str], steps: int = 1000, long_steps: bool = False) -> Run:
    """`setup` started with trainer (or example) flags `extra` (CKPT: the run's checkpoint folder), once it is
    past step 2 or has ended (`Run.start`); every process is stopped by Run.stop().

    A rendezvous port picked free a moment ago can be taken by another process before torchrun or rank 0
    binds it. CI on d94243b: megatron-hang's torchrun exited with EADDRINUSE, and the trial waited 120 s for
    a run that had ended. Such a run is started again, on other ports, in a fresh folder."""
    for attempt in range(1, START_TRIES + 1):
        where = base if attempt == 1 else base / f"start{attempt}"
        run = _launch(setup, where, [str(where / "ckpt") if a == "CKPT" else a for a in extra], steps, long_steps)
        try:
            run.start = wait_for(run.start_state, 120, 0.2) or "slow"
        except BaseException:
            run.stop()
            raise
        if run.start != "port-taken" or attempt == START_TRIES:
            return run
        run.stop()
    raise AssertionError("unreachable")


def _launch(setup: str, base: Path, extra: list[str], steps: int, long_steps: bool) -> Run:
    base.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PARWATCH_TOKEN=TOKEN, TRAINER_THREADS="1", PYTHONPATH=str(ROOT))
    fwd, bwd = (LONG_FWD_MS, LONG_BWD_MS) if long_steps else (FWD_MS, BWD_MS)
    if setup == "ref":
        from parwatch.contract import new_run_id

        leader = Sidecar(base, "node0").start()
        out = base / "trainer.out"
        argv = [*_ref_args(steps, fwd, bwd), "--parwatch", "on", "--parwatch-endpoint", leader.url]
        argv += ["--parwatch-log", str(base / "log"), "--run-id", new_run_id(), *extra]
        ctx, port = _forkserver(), free_port()
        procs = [ctx.Process(target=_rank_main, args=(argv, r, 4, port, str(out))) for r in range(4)]
        for p in procs:
            p.start()
        return Run(setup, base, [leader], [_Forked(p) for p in procs], [out])
    if setup == "ref2":
        leader = Sidecar(base, "node0").start()
        node1 = Sidecar(base, "node1", "--leader-url", leader.url).start()
        outs = [base / f"node{k}-trainer.out" for k in (0, 1)]
        args = [
            [*_ref_args(steps, fwd, bwd), "--parwatch-endpoint", s.url, "--parwatch-log", str(base / f"log{k}"), *extra]
            for k, s in enumerate((leader, node1))
        ]
        procs = launch_nodes(outs, args, [env, env], nproc_per_node=2)
        return Run(setup, base, [leader, node1], procs, outs)
    # the frameworks' examples: PP2 under torchrun, synthetic compute
    leader = Sidecar(base, "node0").start()
    example, layout = {
        "pipelining": ("torch_pipelining.py", ["--microbatches", "4"]),
        "megatron": ("megatron_gpt.py", ["--tp", "1", "--pp", "2", "--microbatches", "4"]),
        "deepspeed": ("deepspeed_pipe.py", ["--pp", "2", "--microbatches", "4"]),
    }[setup]
    out = base / "trainer.out"
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(ROOT / "examples" / example)]
    cmd += [*layout, "--synthetic-ms", f"{FWD_MS:g},{BWD_MS:g}", "--steps", str(steps)]
    cmd += ["--parwatch-endpoint", leader.url, "--parwatch-log", str(base / "log"), *extra]
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Run(setup, base, [leader], [proc], [out], framework=True)


# ------------------------------------------------------------------------------------ fault kinds


@dataclass
class Trial:
    kind: str
    setup: str
    seed: int
    inject: list = field(default_factory=list)
    """Trainer flags that inject the fault."""
    action: str | None = None
    """An external fault the campaign applies at `step`: kill (SIGKILL a rank), stop-node, kill-sidecar."""
    step: int = 0
    """The step the fault strikes (a straggler: the first slow step)."""
    expect: dict = field(default_factory=dict)
    """rule, and what the finding must name: rank, stage, place (the culprit's span kind), cause."""


REF = ("ref", "ref2")
HANG_PLACES = {  # kind -> (--inject place, the culprit's span, the hang's kind)
    "hang-forward": ("compute", "forward", "host"),
    "hang-backward": ("backward", "backward", "host"),
    "hang-tp-collective": ("collective", "forward", "host"),
    "hang-send": ("send", "send", "transport"),
    "hang-recv": ("recv", "recv", "transport"),
    "hang-boundary": ("boundary", None, "host"),
}
SLOW = {"slow-5pct": 0.05, "slow-10pct": 0.10, "slow-50pct": 0.50}
KINDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(HANG_PLACES, REF),
    "kill": REF,
    "exception": REF,
    "node-stop": ("ref2",),
    "sidecar-kill": ("ref2",),
    **dict.fromkeys(SLOW, REF),
    "slow-data": REF,
    "slow-link": REF,
    "nan-transient": ("ref",),
    "nan-persistent": ("ref",),
    "loss-spike": ("ref",),
    "pipelining-hang": ("pipelining",),
    "pipelining-crash": ("pipelining",),
    "megatron-hang": ("megatron",),
    "megatron-crash": ("megatron",),
    "deepspeed-hang": ("deepspeed",),
    "deepspeed-crash": ("deepspeed",),
}
"""Fault kind -> the setups it runs on (a trial draws one)."""
PP_LINKS = [(0, 2), (1, 3), (2, 0), (3, 1)]


def draw(kind: str, seed: int, setup: str | None = None) -> Trial:
    """One trial of `kind`, its place, step and size drawn from `seed`."""
    rng = random.Random(f"{kind}:{seed}")
    setup = setup or rng.choice(KINDS[kind])
    rank, step = rng.randrange(4), rng.randint(8, 14)
    t = Trial(kind, setup, seed, step=step)
    if kind in HANG_PLACES:
        where, place, hang_kind = HANG_PLACES[kind]
        t.inject = ["--inject", f"hang:rank={rank},step={step},where={where}"]
        t.expect = {"rule": "hang", "rank": rank, "stage": rank // 2, "place": place, "cause": hang_kind}
    elif kind == "kill":
        t.action = "kill"
        t.expect = {"rule": "rank-gone", "rank": rank, "stage": rank // 2, "cause": "gone"}
    elif kind == "exception":
        t.inject = ["--inject", f"raise:rank={rank},step={step}"]
        t.expect = {"rule": "rank-gone", "rank": rank, "stage": rank // 2, "cause": "InjectedError"}
    elif kind == "node-stop":
        t.action = "stop-node"
        t.expect = {"rule": "rank-gone", "ranks": [2, 3], "cause": "node-lost"}
    elif kind == "sidecar-kill":
        t.action = "kill-sidecar"
        t.expect = {"rule": "sidecar-lost", "ranks": [2, 3], "cause": "sidecar-lost"}
    elif kind in SLOW:
        ms = SLOW[kind] * (FWD_MS + BWD_MS)  # per microbatch: that share of the rank's compute
        t.inject = ["--inject", f"straggler:rank={rank},ms={ms:g},from_step={step}"]
        t.expect = {"rule": "straggler", "rank": rank, "stage": rank // 2, "cause": "slow-compute"}
    elif kind == "slow-data":
        t.inject, t.step = ["--inject", f"slow-data:rank={rank},ms=20"], 6  # from the start: judged from step 6
        t.expect = {"rule": "straggler", "rank": rank, "stage": rank // 2, "cause": "slow-data"}
    elif kind == "slow-link":
        src, dst = rng.choice(PP_LINKS)
        t.inject, t.step = ["--inject", f"slow-link:src={src},dst={dst},ms=20"], 6
        t.expect = {"rule": "straggler", "src": src, "dst": dst, "cause": "slow-link"}
    elif kind in ("nan-transient", "nan-persistent", "loss-spike"):
        # The check before the optimizer step (issue 42) judges each: re-run, then applied or skipped.
        spec, triage = {
            "nan-transient": ("nan", "transient"),
            "nan-persistent": ("bad-batch", "persistent"),
            "loss-spike": ("loss-spike", "transient"),
        }[kind]
        t.inject = ["--inject", f"{spec}:step={step}", *_checkpoints()]
        rule = "step-spike" if kind == "loss-spike" else "step-nonfinite"
        t.expect = {"rule": rule, "step": step, "cause": triage}
    else:  # a framework's hang or crash, PP2: rank = stage
        stage = rng.randrange(2)
        flag = "--hang-at" if kind.endswith("hang") else "--crash-at"
        t.inject = [flag, f"{stage}:{step}"]
        rule = "hang" if kind.endswith("hang") else "rank-gone"
        t.expect = {"rule": rule, "rank": stage, "stage": stage, "cause": "host" if rule == "hang" else "gone"}
        if rule == "hang":  # blocked running its forward, the other stage waiting for it
            t.expect |= {"place": SpanKind.FORWARD, "state": RankState.RUNNING, "waiting": [1 - stage]}
    return t


def _checkpoints() -> list[str]:
    return ["--checkpoint-dir", "CKPT", "--checkpoint-every", "4"]


# ------------------------------------------------------------------------------------ one trial


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def _findings(run: Run) -> list[dict]:
    """Every decision a rule or the hang monitor made (not the operator's own)."""
    return [d for d in run.leader.decisions() if d.get("source") != "operator"]


def run_trial(t: Trial, base: Path) -> dict:
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    result = _run_trial(t, base, lambda name: phases.setdefault(name, round(time.monotonic() - t0, 2)))
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    result["phase_seconds"] = phases  # when each phase ended, from the trial's start: where its wall goes
    return result


def _run_trial(t: Trial, base: Path, phase=lambda name: None) -> dict:
    run = start_run(t.setup, base, t.inject)
    phase("started")
    fault_at: float | None = None
    try:
        if run.start != "started":
            return _result(t, run, None, None, error=f"the run did not reach step 2 ({run.start})")
        if t.action is not None:
            if not wait_for(lambda: run.last_step() >= t.step, 120, 0.05):
                return _result(t, run, None, None, error=f"the run did not reach step {t.step}")
            fault_at = _apply(t, run)
        expected = t.expect["rule"]
        timeout = 60.0 if expected in ("straggler", "step-nonfinite", "step-spike") else 40.0
        ready = wait_for(lambda: [d for d in _findings(run) if d["rule"] == expected], timeout + 30, 0.1)
        phase("decided")
        if ready and expected in ("hang", "rank-gone"):
            _wait_evidence(run, ready[0])
        if not ready:
            time.sleep(0.5)
        fault_at = fault_at or _fault_time(t, run)
        result = _result(t, run, fault_at, ready[0] if ready else None)
        phase("judged")
        return result
    finally:
        run.stop()
        phase("stopped")


def _apply(t: Trial, run: Run) -> float:
    """The campaign's own faults: SIGKILL a rank, SIGSTOP node 1 whole, SIGKILL node 1's sidecar."""
    if t.action == "kill":
        pid = run.rank_pid(t.expect["rank"])
        assert pid is not None, f"rank {t.expect['rank']}'s process not found"
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return at
    node1 = run.sidecars[1]
    if t.action == "kill-sidecar":
        at = time.time()
        node1.proc.kill()
        return at
    pids = [run.procs[1].pid, *_descendants(run.procs[1].pid), node1.proc.pid]
    at = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    return at


def _descendants(pid: int) -> list[int]:
    out, frontier = [], [pid]
    while frontier:
        nxt = [c for p in frontier for c in _children(p)]
        out += nxt
        frontier = nxt
    return out


def _fault_time(t: Trial, run: Run) -> float | None:
    """When an injected fault struck: the time it logged, or for a straggler or a loss fault the end of the
    step before it (rank 0's summary)."""
    if t.kind in HANG_PLACES or t.kind.endswith("hang"):
        return run.logged_time("hang")
    if t.kind == "exception":
        return run.logged_time("exception")
    if t.kind.endswith("crash"):
        return run.logged_time("crash")
    summaries = [s for p in run.base.glob("log*/summaries.jsonl") for s in read_jsonl(p) if s.get("rank") == 0]
    before = [s["time"] for s in summaries if s.get("step") == t.step - 1]
    return min(before) if before else None


def _wait_evidence(run: Run, decision: dict) -> None:
    """Until every rank reachable at the decision sent its evidence, or none is left to send (after a crash
    its peers end too: waiting the 8 s out cost --quick ~25 s of its 4 minutes)."""
    bundle = (decision.get("evidence") or {}).get("bundle")
    if bundle:
        wait_for(lambda: (_evidence_files(run, decision) and _reachable_done(run, decision)) or run.ended(), 8.0, 0.2)


def _evidence_files(run: Run, decision: dict) -> list[Path]:
    bundle = (decision.get("evidence") or {}).get("bundle")
    return sorted((run.leader.state_dir / bundle).glob("rank*.json")) if bundle else []


def _reachable_done(run: Run, decision: dict) -> bool:
    asked = next((e for e in run.leader.status().get("evidence", []) if e["decision"] == decision["id"]), None)
    return asked is not None and set(asked["expected"]) <= set(asked["ranks"])


def _culprit_of(d: dict) -> dict:
    ev = d.get("evidence") or {}
    return (ev.get("culprit") or {}) if d["rule"] in ("hang", "rank-gone") else (ev.get("culprit") or {})


def judge(t: Trial, d: dict | None) -> dict:
    """detected, right kind, right culprit, right cause of the trial's first matching finding."""
    e = t.expect
    if d is None:
        return {"detected": False, "right_kind": False, "right_culprit": False, "right_cause": False}
    ev = d.get("evidence") or {}
    c = _culprit_of(d)
    rule = d["rule"]
    right_kind = rule == e["rule"]
    if rule == "hang":  # what a trial does not expect (its place, state, waiters) is not judged
        culprit = (c.get("rank"), c.get("stage"), c.get("kind"), c.get("state"), ev.get("waiting")) == (
            e["rank"],
            e["stage"],
            e.get("place", c.get("kind")),
            e.get("state", c.get("state")),
            e.get("waiting", ev.get("waiting")),
        )
        cause = ev.get("kind") == e["cause"]
    elif rule == "rank-gone" and e["cause"] == "node-lost":
        culprit = set(e["ranks"]) <= set(ev.get("gone") or []) and not c
        cause = ev.get("cause") == "node-lost"
    elif rule == "rank-gone":
        culprit = (c.get("rank"), c.get("stage")) == (e["rank"], e["stage"])
        cause = (c.get("state") == "gone") if e["cause"] == "gone" else str(c.get("error", "")).startswith(e["cause"])
    elif rule == "sidecar-lost":
        culprit = ev.get("ranks") == e["ranks"]
        cause = True
    elif rule == "straggler":
        where = c
        if e["cause"] == "slow-link":
            culprit = (where.get("src"), where.get("dst")) == (e["src"], e["dst"])
        else:
            culprit = where.get("rank") == e["rank"] and where.get("stage") == e["stage"]
        cause = where.get("cause") == e["cause"]
    else:  # the step check's findings: the step, and transient (re-run, applied) or persistent (skipped)
        culprit = d.get("step") == e["step"]
        cause = d.get("triage") == e["cause"]
    return {"detected": True, "right_kind": right_kind, "right_culprit": bool(culprit), "right_cause": bool(cause)}


def _result(t: Trial, run: Run, fault_at: float | None, d: dict | None, error: str | None = None) -> dict:
    findings = _findings(run)
    out = {**asdict(t), **judge(t, d), "error": error}
    out["finding"] = None if d is None else {k: d.get(k) for k in ("id", "rule", "step", "time", "reason")}
    out["other_findings"] = [
        {k: f.get(k) for k in ("rule", "step", "reason")} for f in findings if d is None or f["id"] < d["id"]
    ]
    out["latency_seconds"] = round(d["time"] - fault_at, 3) if d is not None and fault_at is not None else None
    if d is not None and t.expect["rule"] in ("straggler", "step-nonfinite", "step-spike") and d.get("step"):
        out["latency_steps"] = d["step"] - t.step
    if d is not None and d["rule"] in ("hang", "rank-gone"):
        files = _evidence_files(run, d)
        out["evidence_ranks"] = len(files)
        out["evidence_seconds"] = round(max(f.stat().st_mtime for f in files) - d["time"], 3) if files else None
        out["bound_seconds"] = (d.get("evidence") or {}).get("bound_seconds")
        out["median_step_seconds"] = (d.get("evidence") or {}).get("median_step_seconds")
    if error or d is None:
        out["output_tail"] = run.output()[-1500:]
    return out


# ---------------------------------------------------------------------------------- healthy runs


@dataclass
class Healthy:
    name: str
    setup: str
    steps: int
    long_steps: bool = False
    pause_s: float = 30.0


def healthy_noise(h: Healthy, rng: random.Random) -> list[str]:
    """The noise of a real run, sized in its nominal steps."""
    step_ms = (LONG_STEP_S if h.long_steps else STEP_S) * 1000
    save_every, eval_every = min(25, max(5, h.steps // 6)), min(50, max(10, h.steps // 3))  # a short run has some
    out = ["--checkpoint-dir", "CKPT", "--checkpoint-every", str(save_every), "--keep-checkpoints", "2"]
    out += ["--inject", f"slow-checkpoint:ms={5 * step_ms:g}"]
    out += ["--inject", f"eval-pause:every={eval_every},ms={10 * step_ms:g}", "--inject", f"warmup:ms={20 * step_ms:g}"]
    for k in range(max(1, h.steps // 150)):  # a 1.5 s stop of one rank every ~150 steps
        at = rng.randint(min(20, h.steps // 4) + 150 * k, 150 * (k + 1) + 10)
        out += ["--inject", f"hiccup:rank={rng.randrange(4)},step={min(at, h.steps - 2)},ms=1500,how=stop"]
    return out


class Neighbour:
    """One CPU-hogging process on the host while any healthy run is on (runs at once share the host).
    Where the host is busy already (less than half a core idle over two seconds), that load is the
    neighbour: a hog on top would only take a core from it. `host_load`: the caller says the host's own
    load is the neighbour (the test suite's other xdist workers, which keep 2 cores busy for the whole
    parallel phase; a hog measured idle in a 2 s dip then held a core from them for the ~95 s of the
    healthy runs: CI's wall time, 2026-12-05)."""

    def __init__(self):
        self._lock, self._users, self._proc = threading.Lock(), 0, None
        self.what = "none"
        """What the neighbour was: "hog", or the host's own load ("host busy: N cores idle")."""
        self.host_load: str | None = None

    def __enter__(self):
        with self._lock:
            self._users += 1
            if self._proc is None and self._users == 1:
                idle = _idle_cores(2.0)
                if self.host_load:
                    self.what = f"{self.host_load}: {idle:.2f} cores idle"
                elif idle < 0.5:
                    self.what = f"host busy: {idle:.2f} cores idle"
                else:
                    self.what = "hog"
                    self._proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None


NEIGHBOUR = Neighbour()


def _idle_cores(seconds: float) -> float:
    """Cores idle over the next `seconds` (the idle and iowait ticks); every core where none are read."""
    before = cpu_ticks()
    time.sleep(seconds)
    after = cpu_ticks()
    if len(before) < 5 or len(after) < 5:
        return float(os.cpu_count() or 1)
    idle = after[3] + after[4] - before[3] - before[4]
    return (os.cpu_count() or 1) * idle / max(1, sum(after[:8]) - sum(before[:8]))


def run_healthy(h: Healthy, base: Path, seed: int) -> dict:
    with NEIGHBOUR:
        return _run_healthy(h, base, seed)


def _run_healthy(h: Healthy, base: Path, seed: int) -> dict:
    rng = random.Random(f"{h.name}:{seed}")
    t0 = time.monotonic()
    run = start_run(h.setup, base, healthy_noise(h, rng), steps=h.steps, long_steps=h.long_steps)
    pause_at = rng.randint(min(30, h.steps // 3), max(min(30, h.steps // 3), h.steps // 2))
    paused = False
    try:
        deadline = t0 + h.steps * (LONG_STEP_S if h.long_steps else STEP_S) * 6 + h.pause_s + 180
        while time.monotonic() < deadline and any(p.poll() is None for p in run.procs):
            if not paused and run.last_step() >= pause_at:
                run.leader.control("pause", reason="campaign: an operator's pause", requested_by="campaign")
                time.sleep(h.pause_s)
                run.leader.control("resume", reason="campaign", requested_by="campaign")
                paused = True
            time.sleep(0.5)
        codes = [p.poll() for p in run.procs]
        time.sleep(2.0)  # findings about the last steps
        summaries = [s for p in run.base.glob("log*/summaries.jsonl") for s in read_jsonl(p) if s.get("rank") == 0]
        steps = max((s["step"] for s in summaries), default=0)
        findings = _findings(run)
        return {
            "name": h.name,
            "setup": h.setup,
            "seed": seed,
            "steps": steps,
            "exit_codes": codes,
            "wall_seconds": round(time.monotonic() - t0, 1),
            "paused_at_step": pause_at if paused else None,
            "neighbour": NEIGHBOUR.what,
            "median_step_seconds": _median_step(summaries),
            "findings": [{k: f.get(k) for k in ("rule", "step", "action", "reason")} for f in findings],
            "error": None if codes and all(c == 0 for c in codes) and steps >= h.steps else run.output()[-1500:],
        }
    finally:
        run.stop()


def _median_step(summaries: list[dict]) -> float | None:
    values = [s["step_seconds"] for s in summaries if s.get("step_seconds")]
    return round(statistics.median(values), 4) if values else None


# ------------------------------------------------------------------------------------ the table


def per_kind(trials: list[dict]) -> list[dict]:
    rows = []
    for kind in KINDS:
        mine = [t for t in trials if t["kind"] == kind]
        if not mine:
            continue
        lat = [t["latency_seconds"] for t in mine if t["latency_seconds"] is not None]
        steps = [t["latency_steps"] for t in mine if t.get("latency_steps") is not None]
        ev = [t for t in mine if t.get("evidence_ranks") is not None]
        rows.append(
            {
                "kind": kind,
                "trials": len(mine),
                "detected": sum(t["detected"] for t in mine),
                "right_kind": sum(t["right_kind"] for t in mine),
                "right_culprit": sum(t["right_culprit"] for t in mine),
                "right_cause": sum(t["right_cause"] for t in mine),
                "p50_s": percentile(lat, 50) if lat else None,
                "p99_s": percentile(lat, 99) if lat else None,
                "max_s": max(lat) if lat else None,
                "max_steps": max(steps) if steps else None,
                "evidence_full": sum(1 for t in ev if t["evidence_ranks"] > 0),
                "evidence_max_s": max(
                    (t["evidence_seconds"] for t in ev if t["evidence_seconds"] is not None), default=None
                ),
                "other_findings": sum(len(t["other_findings"]) for t in mine),
            }
        )
    return rows


def per_healthy(healthy: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(h["name"] for h in healthy):
        mine = [h for h in healthy if h["name"] == name]
        steps = sum(h["steps"] for h in mine)
        findings = [f for h in mine for f in h["findings"]]
        perf = [f for f in findings if f["rule"] in ("straggler", "collective-latency-regression")]
        judged = [f for f in findings if judged_healthy(f)]
        rows.append(
            {
                "config": name,
                "steps": steps,
                "findings": len(findings),
                "by_rule": {
                    r: sum(1 for f in findings if f["rule"] == r) for r in sorted({f["rule"] for f in findings})
                },
                "straggler_or_link_per_10k": round(len(perf) * 10_000 / steps, 2) if steps else None,
                "hang_crash_action": len([f for f in judged if f not in perf]),
                "shape_rules": len(findings) - len(judged),
                "median_step_s": statistics.median([h["median_step_seconds"] for h in mine if h["median_step_seconds"]])
                if any(h["median_step_seconds"] for h in mine)
                else None,
            }
        )
    return rows


def print_tables(kinds: list[dict], healthy: list[dict]) -> None:
    print("\nfault kinds")
    print_table(
        ["kind", "trials", "detected", "kind ok", "culprit ok", "cause ok", "p50 s", "p99 s", "max s", "max steps",
         "evidence", "evid. max s", "other"],
        [[r["kind"], r["trials"], r["detected"], r["right_kind"], r["right_culprit"], r["right_cause"], r["p50_s"],
          r["p99_s"], r["max_s"], r["max_steps"], r["evidence_full"], r["evidence_max_s"], r["other_findings"]]
         for r in kinds],
    )  # fmt: skip
    print("\nhealthy configurations")
    print_table(
        ["config", "steps", "median step s", "findings", "straggler/link per 10k", "hang/crash/action",
         "shape rules", "by rule"],
        [[r["config"], r["steps"], r["median_step_s"], r["findings"], r["straggler_or_link_per_10k"],
          r["hang_crash_action"], r["shape_rules"], r["by_rule"] or "-"] for r in healthy],
    )  # fmt: skip


GOAL_RULES = (
    "hang",
    "rank-gone",
    "sidecar-lost",
    "step-nonfinite",
    "step-spike",
    "nonfinite-loss",
    "loss-spike",
    "straggler",
    "collective-latency-regression",
)
"""Findings the issue's healthy-run goals count (false hangs, crashes and actions: none; stragglers and links:
at most 1 in 10,000 steps): --quick fails on any. The shape rules (stage-skew, bubble-excess) judge how
balanced the pipeline is, which a CPU-hogging neighbour truly changes for a few steps; they are reported
per configuration, not failed on."""


def judged_healthy(f: dict) -> bool:
    """A healthy run's finding that a goal counts: a goal rule's, or any that acts (a pause, a rollback)."""
    return f["rule"] in GOAL_RULES or f.get("action") not in (None, "alert")


def failures(trials: list[dict], healthy: list[dict]) -> list[str]:
    """What --quick fails on: a kind missed or misjudged, any finding in a healthy run, a healthy run that broke."""
    out = [
        f"{t['kind']} on {t['setup']} (seed {t['seed']}): "
        + ("missed" if not t["detected"] else "wrong " + ", ".join(k for k in ("right_kind", "right_culprit", "right_cause") if not t[k]))
        + f"; {t['finding']['reason'] if t['finding'] else t.get('error') or ''}"
        for t in trials
        if not (t["detected"] and t["right_kind"] and t["right_culprit"] and t["right_cause"])
    ]  # fmt: skip
    for h in healthy:
        out += [
            f"{h['name']}: a healthy run raised {f['rule']} at step {f['step']}: {f['reason']}"
            for f in h["findings"]
            if judged_healthy(f)
        ]
        if h["error"]:
            out.append(f"{h['name']}: the healthy run did not complete: {h['error'][-500:]}")
    return out


# ------------------------------------------------------------------------------------- the campaign


QUICK_HEALTHY = ("healthy-2node", "healthy-long-steps")
"""--quick's healthy runs (two nodes cover one node's noise and the nodes' own; long steps the busy bound)."""
HEALTHY = [
    Healthy("healthy-1node", "ref", 10_000),
    Healthy("healthy-2node", "ref2", 10_000),
    Healthy("healthy-long-steps", "ref", 2_000, long_steps=True),
]


class Journal:
    """Every finished trial and healthy run, one JSON line each, keyed by what drew it: a campaign of hours
    stopped midway (a reboot, a lost session) resumes where it was, with the same draws."""

    def __init__(self, path: Path | None, resume: bool):
        self.path = path
        self.done: dict[str, dict] = {}
        if path is not None and resume and path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry["result"]
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def add(self, key: str, result: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "result": result}, default=str) + "\n")


def campaign(
    trials_per_kind: int,
    healthy_steps: int,
    seed: int,
    jobs: int,
    quick: bool,
    kinds: list[str],
    healthy_names=(),
    journal: Journal | None = None,
) -> dict:
    journal = journal or Journal(None, False)
    plan = []
    for kind in kinds:
        for i in range(trials_per_kind):
            setups = KINDS[kind]  # --quick: one trial, the kinds alternating over their setups
            # --quick: one trial, on the setup a kind needs (the one-node trainer where it has the choice:
            # its ranks fork from a preloaded server, seconds faster than two torchrun nodes)
            plan.append((f"{seed}:{kind}:{i}:{quick}", draw(kind, seed * 1000 + i, setups[0] if quick else None)))
    healthy_plan = [
        (
            f"{seed}:{h.name}:{healthy_steps}:{quick}",
            Healthy(
                h.name,
                h.setup,
                max(40, healthy_steps // (3 if h.long_steps else 1)),
                h.long_steps,
                5.0 if quick else 30.0,
            ),
        )
        for h in HEALTHY
        if healthy_steps > 0 and (h.name in healthy_names if healthy_names else not quick or h.name in QUICK_HEALTHY)
    ]
    trials, healthy = [], []
    lock = threading.Lock()
    resumed = 0
    for key, item in [*plan, *healthy_plan]:
        if key in journal.done:
            (healthy if isinstance(item, Healthy) else trials).append(journal.done[key])
            resumed += 1

    def one(keyed):
        key, item = keyed
        if key in journal.done:
            return
        keep = os.environ.get("PARWATCH_CAMPAIGN_KEEP")  # a directory: every trial's files stay there
        with (
            contextlib.nullcontext(tempfile.mkdtemp(prefix="parwatch-campaign-", dir=keep))
            if keep
            else tempfile.TemporaryDirectory(prefix="parwatch-campaign-")
        ) as tmp:
            if isinstance(item, Healthy):
                r = run_healthy(item, Path(tmp), seed)
                r["files"] = tmp if keep else None
                with lock:
                    healthy.append(r)
                    journal.add(key, r)
                    print(
                        f"{r['name']}: {r['steps']} steps, {len(r['findings'])} findings ({r['wall_seconds']} s; neighbour: "
                        f"{r['neighbour']}){'; its files: ' + tmp if keep else ''}",
                        flush=True,
                    )
            else:
                r = run_trial(item, Path(tmp))
                r["files"] = tmp if keep else None
                with lock:
                    trials.append(r)
                    journal.add(key, r)
                    ok = all(r[k] for k in ("detected", "right_kind", "right_culprit", "right_cause"))
                    steps = "" if r.get("latency_steps") is None else f" ({r['latency_steps']} steps)"
                    what = (r["finding"] or {}).get("reason") or r.get("error") or "no finding"
                    print(
                        f"{r['kind']:<20} {r['setup']:<10} {'ok ' if ok else 'BAD'} {r['wall_seconds']:>5} s, latency {r['latency_seconds']} s"
                        f"{steps}  {what[:140]}",
                        flush=True,
                    )

    jiffies, t0 = cpu_jiffies(), time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        if quick:  # the short healthy runs beside the fault trials (their neighbour): its wall is the trials'
            with ThreadPoolExecutor(max_workers=max(1, len(healthy_plan))) as beside:
                healthy_runs = [beside.submit(one, h) for h in healthy_plan]
                list(pool.map(one, plan))
                for future in healthy_runs:
                    future.result()
        else:
            list(pool.map(one, [*healthy_plan, *plan]))  # the long healthy runs first
    return {
        "seed": seed,
        "trials_per_kind": trials_per_kind,
        "healthy_steps": healthy_steps,
        "jobs": jobs,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "resumed_from_journal": resumed,
        "cpu_stolen_share": stolen_share(jiffies, cpu_jiffies()),
        "load_average": os.getloadavg(),
        "kinds": per_kind(trials),
        "healthy": per_healthy(healthy),
        "trials": trials,
        "healthy_runs": healthy,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per fault kind")
    ap.add_argument("--healthy-steps", type=int, default=10_000, help="steps of each healthy configuration")
    ap.add_argument(
        "--runs", type=int, default=1, help="whole campaigns, one after the other (seeds seed, seed+1, ...)"
    )
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--jobs", type=int, default=1, help="trials at once (1 for latency figures; --quick uses 2)")
    ap.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
    ap.add_argument("--healthy", default="", help="comma-separated healthy configurations (default: all)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one trial per kind, 2 at once, beside 2 short healthy runs (120 and 40 steps)",
    )
    ap.add_argument(
        "--out", default=None, help="write the JSON here (default benchmarks/results/fault_campaign[_quick].json)"
    )
    ap.add_argument(
        "--neighbour-is",
        default=None,
        metavar="WHAT",
        help="the host's own load is the healthy runs' neighbour (named WHAT in the JSON): start no CPU hog",
    )
    ap.add_argument(
        "--journal",
        default=None,
        help="append every finished trial and healthy run here (default: the --out path with .journal.jsonl)",
    )
    ap.add_argument("--resume", action="store_true", help="take the trials the journal holds, run only the rest")
    a = ap.parse_args(argv)
    NEIGHBOUR.host_load = a.neighbour_is or ("the fault trials beside them" if a.quick else None)
    if a.quick:
        a.trials, a.healthy_steps, a.jobs = 1, 120, max(a.jobs, 2)
    kinds = [k for k in a.kinds.split(",") if k] or list(KINDS)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds: unknown {sorted(unknown)}; one of {', '.join(KINDS)}")
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"fault_campaign{'_quick' if a.quick else ''}.json")
    journal = Journal(Path(a.journal) if a.journal else out.with_suffix(".journal.jsonl"), a.resume)
    runs = []
    for r in range(a.runs):
        healthy_names = [n for n in a.healthy.split(",") if n]
        result = campaign(a.trials, a.healthy_steps, a.seed + r, a.jobs, a.quick, kinds, healthy_names, journal)
        print(f"\ncampaign run {r + 1} of {a.runs} (seed {a.seed + r}): {result['wall_seconds']} s, "
              f"stolen CPU {result['cpu_stolen_share']:.1%}")  # fmt: skip
        print_tables(result["kinds"], result["healthy"])
        runs.append(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1, default=str))
    print(f"\nwrote {out}")
    bad = [f for r in runs for f in failures(r["trials"], r["healthy_runs"])]
    for line in bad:
        print("FAIL", line)
    for r in runs:
        for h in r["healthy_runs"]:
            for f in h["findings"]:
                if not judged_healthy(f):
                    print(f"noted (a shape rule, no goal): {h['name']} step {f['step']}: {f['reason']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
