"""The collector inside a real TP2 x PP2 run: its collective census, and a sidecar that is away.

One 4-rank spawn runs the same small model (real compute, same seed) four times:
  logged  collector on, --parwatch-log only: the per-step collectives every rank reports
          must be Megatron's count (tests/dist/test_census.py's formula), with the bytes,
          and bus bandwidth as nccl-tests defines it;
  off     --parwatch off: the reference losses;
  closed  --parwatch-endpoint on a port nobody listens on: every step completes with the
          same losses, and the summaries that could not be sent are counted;
  silent  --parwatch-endpoint on a server that accepts and never answers: training does
          not wait for it (the shipper's thread does, up to its timeout).
"""

from __future__ import annotations

import inspect
import socket
import threading

import pytest

from parwatch.collector.shipper import Shipper
from tests.dist.test_bubble_fidelity import read_run, train_runs
from tests.dist.test_census import (
    ACT_BYTES,
    BATCH,
    HIDDEN,
    LAYERS,
    SEQ,
    M,
    expected_p2p,
    expected_tp,
)
from tests.distutil import free_port, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

STEPS = 6
WORLD = 4
MODEL = {
    "tp": 2,
    "pp": 2,
    "layers": LAYERS,
    "hidden": HIDDEN,
    "heads": 4,
    "vocab": 64,
    "seq_len": SEQ,
    "micro_batch_size": BATCH,
    "microbatches": M,
    "steps": STEPS,
    "schedule": "1f1b",
}


class SilentSidecar:
    """A TCP server on 127.0.0.1 that accepts connections and never reads or answers: a hung sidecar."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-sidecar", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)  # held open, never answered

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self._sock.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("collector")
    silent = SilentSidecar()
    closed_port = free_port()  # bound and released: nobody listens there
    try:
        per_rank = run_ranks(
            train_runs,
            WORLD,
            {
                "logged": dict(MODEL, parwatch="on"),
                "off": dict(MODEL, parwatch="off"),
                "closed": dict(MODEL, parwatch="on", parwatch_endpoint=f"http://127.0.0.1:{closed_port}"),
                "silent": dict(MODEL, parwatch="on", parwatch_endpoint=f"http://127.0.0.1:{silent.port}"),
            },
            str(out),
            timeout=120,
        )
        connections = len(silent.accepted)
    finally:
        silent.close()
    return {"out": out, "per_rank": per_rank, "silent_connections": connections}


def collectives_by_step(steps: list[dict]) -> dict:
    """(rank, step) -> {(op, group): collective entry} from the step summaries."""
    return {(s["rank"], s["step"]): {(c["op"], c["group"]): c for c in s["collectives"]} for s in steps}


def test_tp_all_reduces_counted_per_step_per_rank(runs):
    summary, steps = read_run(runs["out"], "logged")
    found = collectives_by_step(steps)
    assert sorted(found) == [(r, n) for r in range(WORLD) for n in range(1, STEPS + 1)]
    for (rank, step), ops in found.items():
        stage = rank // 2  # TP ranks are adjacent
        want = expected_tp(stage, step)
        tp = ops[("all_reduce", "tp")]
        assert tp["count"] == sum(want.values()), (rank, step)
        assert tp["bytes"] == sum(n * nbytes for (_, _, _, nbytes), n in want.items()), (rank, step)
        assert tp["algbw"] == pytest.approx(tp["bytes"] / tp["seconds"], rel=1e-9)
        assert tp["busbw"] == pytest.approx(tp["algbw"] * 1.0, rel=1e-9)  # 2(n-1)/n with n=2
        assert tp["buckets"][-1] == tp["count"]  # every latency in the histogram (+Inf bucket)
    # Rank 0's run totals (--summary-json) add its steps up.
    totals = {(c["op"], c["group"]): c for c in summary["collectives_rank0"]}
    per_step_tp = sum(expected_tp(0, 1).values())
    assert totals[("all_reduce", "tp")]["count"] == STEPS * per_step_tp


def test_p2p_per_step_and_the_boundary_is_no_collective_sample(runs):
    _, steps = read_run(runs["out"], "logged")
    for (rank, step), ops in collectives_by_step(steps).items():
        stage = rank // 2
        # The boundary all-reduce is mostly the flush wait, not a transfer: it is not a latency sample.
        assert set(ops) == {("all_reduce", "tp"), ("send", "pp"), ("recv", "pp")}
        want = expected_p2p(stage, step, 1)
        for op in ("send", "recv"):
            entry = ops[(op, "pp")]
            count = sum(n for (_, kind, _, _), n in want.items() if kind == op)
            assert count == M  # one direction each way on a 2-stage pipeline: m per step
            assert (entry["count"], entry["bytes"]) == (count, count * ACT_BYTES), (rank, step, op)
            assert entry["busbw"] == pytest.approx(entry["algbw"], rel=1e-9)


def test_collector_changes_no_loss(runs):
    off = runs["per_rank"][0]["off"]["losses"]
    assert len(off) == STEPS and all(isinstance(x, float) for x in off)
    for name in ("logged", "closed", "silent"):
        for rank, results in enumerate(runs["per_rank"]):
            assert results[name]["losses"] == off, (name, rank)


def test_sidecar_away_drops_and_counts(runs):
    summary, steps = read_run(runs["out"], "closed")
    assert summary["steps_completed"] == STEPS
    for rank in range(WORLD):
        mine = [s for s in steps if s["rank"] == rank]
        assert [s["step"] for s in mine] == list(range(1, STEPS + 1))  # the log still gets every step
        counts = [s["dropped_total"] for s in mine]
        assert counts == sorted(counts)  # a counter
    last = max((s for s in steps if s["rank"] == 0), key=lambda s: s["step"])
    print(f"\nsidecar away: rank 0's last summary (step {last['step']}) dropped_total={last['dropped_total']}")
    assert last["dropped_total"] > 0


def test_a_hung_sidecar_does_not_hold_training(runs):
    assert runs["silent_connections"] >= 1  # the collector did try it
    read_timeout = inspect.signature(Shipper).parameters["timeout_s"].default
    for rank, results in enumerate(runs["per_rank"]):
        silent, off = results["silent"]["step_seconds"], results["off"]["step_seconds"]
        assert len(silent) == STEPS
        print(f"\nrank {rank}: step seconds, sidecar silent {sum(silent):.3f} s, collector off {sum(off):.3f} s")
        # Had the training thread waited on one POST, that step alone would take the read timeout.
        assert sum(silent) - sum(off) < read_timeout, (rank, silent, off)
