"""A crash and a restart under the same run id, end to end: the real trainer (2 ranks, PP2) dies at a step,
is started again with --resume, and the real sidecar's goodput ledger shows the gap as `down`, the
replayed steps as wasted, and still sums, per rank, to the wall time since the first process started.

The process start times this test checks against are read from /proc here, not from parwatch.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests import one_client
from tests.integration.e2e_util import (
    SMALL_MODEL,
    descendants,
    metric_value,
    read_jsonl,
    run_trainer,
    running_trainer,
    token_args,
    wait_until,
)
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RUN_ID = "restart-e2e"
CRASH_STEP = 8  # rank 1 exits hard (os._exit) at this step; the newest checkpoint is then step 6
GAP_S = 2.0  # how long no process of the run exists between the crash and the restart


def process_start(pid: int) -> float | None:
    """When `pid` started, unix seconds (its /proc starttime against /proc/uptime; 10 ms ticks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def rank_processes(launcher_pid: int) -> list[float]:
    """The start times of the launcher's rank processes: the children of its fork server (each a fork of
    it, under the server's command line)."""

    def cmdline(pid: int) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    starts = []
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"forkserver" not in cmdline(pid) or b"forkserver" not in cmdline(parent):
            continue
        started = process_start(pid)
        if started is not None:
            starts.append(started)
    return starts


def ledger_counters(metrics_url: str) -> dict[int, dict[str, float]]:
    """rank -> category -> parwatch_time_seconds_total, from the sidecar's /metrics."""
    out: dict[int, dict[str, float]] = {}
    pattern = re.compile(r'^parwatch_time_seconds_total\{category="(\w+)",rank="(\d+)",stage="\d+"\} (\S+)$')
    for line in one_client.get(f"{metrics_url}/metrics", timeout=10).text.splitlines():
        match = pattern.match(line)
        if match:
            out.setdefault(int(match.group(2)), {})[match.group(1)] = float(match.group(3))
    return out


def test_a_crash_and_restart_shows_the_gap_as_down_and_the_replayed_steps_as_wasted(tmp_path):
    ckpt = tmp_path / "ckpt"
    with running_sidecar(tmp_path / "state") as sp:
        args = (*SMALL_MODEL, "--pp", "2", "--run-id", RUN_ID, "--timeout-s", "10", *token_args(sp))
        args += ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
        with running_trainer(
            sp.control_url, tmp_path / "first", 12, *args, "--inject", f"crash:rank=1,step={CRASH_STEP}"
        ) as first:
            starts = wait_until(lambda: len(s := rank_processes(first.proc.pid)) == 2 and s, "the first ranks")
            code = first.proc.wait(120)
            exited = time.time()
            assert code != 0, first.output()
            crashed = first.fault_at()
            assert crashed is not None, first.output()
        first_start = min(starts)
        time.sleep(GAP_S)

        with running_trainer(sp.control_url, tmp_path / "second", 12, *args, "--resume") as second:
            restarts = wait_until(lambda: len(s := rank_processes(second.proc.pid)) == 2 and s, "the restarted ranks")
            assert second.proc.wait(120) == 0, second.output()
        assert "resumed run restart-e2e from its checkpoint at step 6" in second.output()
        resumed = json.loads(second.summary_path.read_text())["losses"]
        assert {s["step"] for s in read_jsonl(second.log_dir / "summaries.jsonl")} == set(range(7, 13))
        for rank in (0, 1):  # its load is checkpoint load, after its start-up
            assert second.ledger(rank)["time_seconds"]["checkpoint_load"] > 0

        # The restarted ranks are up again, and nothing took the crash and the gap for a hang.
        assert metric_value(sp.metrics_url, "parwatch_hang_detected") == 0.0
        metrics = one_client.get(f"{sp.metrics_url}/metrics", timeout=10).text
        shown = [m for m in metrics.splitlines() if m.startswith("parwatch_rank_up")]
        assert 'parwatch_rank_up{rank="0"} 1.0' in metrics, (shown, sp.log()[-3000:])
        ledgers = wait_until(
            lambda: len(c := ledger_counters(sp.metrics_url)) == 2 and all(r["productive"] for r in c.values()) and c,
            "both ranks' ledgers on /metrics",
        )
        replayed = 0
        for rank, ledger in sorted(ledgers.items()):
            summaries = [s for s in read_jsonl(second.log_dir / "summaries.jsonl") if s["rank"] == rank]
            last = max(summaries, key=lambda s: s["step"])
            # Down: no process of this rank ran from (at the latest) the first launcher's exit until the
            # new one started; the old one's last report reached the sidecar at most a few steps (and
            # a post, under load) before the crash.
            low, high = min(restarts) - exited, max(restarts) - crashed + 1.0
            print(f"rank {rank}: down {ledger['down']:.3f} s, expected within [{low:.3f}, {high:.3f}]")
            assert low - 0.02 <= ledger["down"] <= high, (rank, ledger, low, high, sp.log()[-3000:])
            # Every second since the first process started lands in one category, across the restart.
            wall = last["time"] - first_start
            counted = sum(v for c, v in ledger.items() if c != "wasted")
            print(f"rank {rank}: {counted:.3f} s counted of {wall:.3f} s since its first start")
            assert counted == pytest.approx(wall, abs=0.05 + 0.01 * wall), ledger
            # The steps the crashed process trained after checkpoint 6 (those whose summaries reached the
            # sidecar, which names the last) were trained again: their productive time is wasted.
            reported = re.search(rf"rank {rank} restarted: .* which reported step (\d+)", sp.log())
            assert reported is not None, sp.log()[-3000:]
            before = {
                s["step"]: s["time_seconds"]["productive"]
                for s in read_jsonl(first.log_dir / "summaries.jsonl")
                if s["rank"] == rank
            }
            # A hard exit loses what the rank had not yet shipped: one that reported no step past the
            # checkpoint's had nothing replayed to count (CI in a venv: rank 1 had reported step 4, its
            # steps 5-7 died with it; their time is down, from its last report).
            last_reported = int(reported.group(1))
            discarded = before[last_reported] - before[6] if last_reported > 6 else 0.0
            replayed += last_reported > 6
            print(
                f"rank {rank}: wasted {ledger['wasted']:.6f} s, discarded steps 7-{reported.group(1)}: {discarded:.6f} s"
            )
            assert ledger["wasted"] == pytest.approx(discarded, rel=0.01, abs=1e-9), ledger
        assert replayed, "no rank had reported a step past the checkpoint: nothing replayed was checked"

    # The resumed run computes what a run that never crashed computes: steps 7-12, bitwise.
    _, whole = run_trainer(None, tmp_path / "whole", 12, *SMALL_MODEL, "--pp", "2")
    assert resumed == whole["losses"][6:], (resumed, whole["losses"])
