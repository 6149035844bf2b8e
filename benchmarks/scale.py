"""parwatch at scale, in simulation: rank 0's step-boundary work and payload at N ranks, and the leader.

    python benchmarks/scale.py [--ranks 16384] [--tp 8] [--pp 16] [--steps 2000] [--runs 3] [--leader-only]
                               [--baseline-tree DIR]
                               [--out benchmarks/results/scale.json]

Rank 0's boundary: every one of the N simulated ranks fills its part of the boundary vector once
(parwatch.contract.StepBoundary + the real Collector), the parts are summed as the SUM all-reduce
would, and rank 0 then runs --steps real boundaries whose all-reduce returns that sum at once. The
time measured is rank 0's own Python work per boundary (packing, decoding, the collector's global
view and summary), not the all-reduce's transfer. The payload per rank is the vector's width x 8 bytes:
the same at every world size.

The leader (digest ingest p99 at N/8 node digests per second, its RSS, the time to name a hang
among N ranks and whether the right rank was named) comes from benchmarks/hang_detection.py, --runs
times, each on a fresh leader, with the share of CPU the host stole during each.

Every node posts its digest with its own node credential (parwatch/credentials.py). With --baseline-tree DIR (a
checkout without issue 43's checks), each leader run is followed by one on a leader of DIR (shared token).

Goals: rank0_boundary_seconds_p50 <= 1 ms at 16,384 ranks; the leader (LEADER_GOALS) in every run:
ingest p99 <= 10 ms, RSS <= 250 MB, the hang named within 10 s, and the right rank named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_jiffies, print_table, stolen_share, write_json  # noqa: E402

from parwatch.collector import Collector, RunContext, attach  # noqa: E402
from parwatch.contract import BoundaryKind, HookRegistry, SpanKind, StepBoundary  # noqa: E402


def _rank(rank: int, a, registry: HookRegistry, reduce) -> tuple[StepBoundary, Collector]:
    ctx = RunContext.for_rank(
        "scale-run", rank, tp=a.tp, pp=a.pp, dp=a.ranks // (a.tp * a.pp), schedule="1f1b", microbatches=a.microbatches
    )
    collector = attach(Collector(ctx, span_sample_steps=None), registry)
    last = ctx.stage == a.pp - 1 and ctx.tp_rank == 0
    return StepBoundary(rank, ctx.world_size, ctx.run_id, reduce, reports_loss=last, registry=registry), collector


def _one_step(registry: HookRegistry, stage: int) -> None:
    """A few spans, so the collector has a step to report."""
    for mb in range(2):
        with registry.span(SpanKind.FORWARD, stage=stage, microbatch=mb, chunk=0):
            pass
        with registry.span(SpanKind.BACKWARD, stage=stage, microbatch=mb, chunk=0):
            pass


def rank0_boundary(a) -> dict:
    """Rank 0's boundary seconds per step and the bytes every rank contributes."""
    world = a.ranks
    # Every rank's contribution to one boundary (after a finished step), summed as the all-reduce does.
    summed, width = None, None
    for rank in range(world):
        reg = HookRegistry()
        parts = []

        def capture(values, parts=parts):
            parts.append(list(values))
            return list(values)

        boundary, collector = _rank(rank, a, reg, capture)
        boundary.exchange(BoundaryKind.START, 0)
        _one_step(reg, collector.ctx.stage)
        boundary.exchange(BoundaryKind.STEP, 1, loss=2.0)
        _one_step(reg, collector.ctx.stage)
        boundary.exchange(BoundaryKind.STEP, 2, loss=2.0)  # reports step 1 into its stage's block
        vec = parts[-1]
        width = len(vec)
        summed = vec if summed is None else [x + y for x, y in zip(summed, vec)]
        collector.close(timeout=1)

    reg = HookRegistry()
    boundary, collector = _rank(0, a, reg, lambda values: summed)
    boundary.exchange(BoundaryKind.START, 0)
    times = []
    for step in range(1, a.steps + 1):
        _one_step(reg, 0)
        t0 = time.perf_counter()
        boundary.exchange(BoundaryKind.STEP, step, loss=2.0)
        times.append(time.perf_counter() - t0)
    g = collector.last_summary.global_
    assert g is not None and sum(s.ranks for s in g.stages) == world, "every rank must be in the view"
    collector.close(timeout=1)
    times.sort()
    return {
        "rank0_boundary_seconds_p50": statistics.median(times),
        "rank0_boundary_seconds_p99": times[int(0.99 * (len(times) - 1))],
        "boundary_bytes_per_rank": width * 8,
        "boundary_floats": width,
    }


LEADER_GOALS = {"leader_ingest_seconds_p99": 0.010, "leader_rss_bytes": 250e6, "hang_named_seconds": 10.0}


def leader_goals(runs: list[dict]) -> dict:
    """Each goal: [its limit, met in every run]."""
    goals = {k: [limit, all(r[k] is not None and r[k] <= limit for r in runs)] for k, limit in LEADER_GOALS.items()}
    goals["named_right"] = [True, all(r["named_right"] for r in runs)]
    return goals


def leader(a) -> dict:
    """The leader at N ranks (benchmarks/hang_detection.py): a real sidecar fed one digest per node
    (8 ranks each) per second over HTTP, a rank hung mid-run, the time until it is named, --runs times;
    and the leader's own per-digest cost in process."""
    import os

    import hang_detection

    runs, base, pinned = [], [], []
    kinds = ((ROOT, runs, False), (a.baseline_tree, base, False), (ROOT if a.pinned else None, pinned, True))
    for tree, out, pin in ((t, o, p) for _ in range(a.runs) for t, o, p in kinds if t):
        jiffies = cpu_jiffies()
        run = hang_detection.simulation(a.ranks, a.warmup, a.connections, a.scrape_seconds, tree=tree, pinned=pin)
        run["leader_cpu_stolen_share"] = stolen_share(jiffies, cpu_jiffies())  # the host's other guests
        run["load_avg_after"] = os.getloadavg()[0]
        run.pop("ranks", None)
        out.append(run)
        print(
            f"leader run {len(out)}/{a.runs}{' (baseline)' if out is base else ' (pinned)' if pin else ''}: ingest p99 "
            f"{run['leader_ingest_seconds_p99'] * 1e3:.1f} ms (healthy {run['leader_ingest_seconds_p99_healthy'] * 1e3:.1f}, "
            f"hung {run['leader_ingest_seconds_p99_hung'] * 1e3:.1f}), "
            f"hang named after {run['hang_named_seconds']} s (right rank: {run['named_right']}), "
            f"RSS {run['leader_rss_bytes'] / 1e6:.0f} MB, stolen CPU {run['leader_cpu_stolen_share']:.0%}, "
            f"load average {run['load_avg_after']:.1f}"
            + (
                f", scraped {run['leader_scrapes']}x, slowest {run['leader_scrape_seconds_max'] * 1e3:.0f} ms"
                if run["leader_scrapes"]
                else ""
            ),
            flush=True,
        )
    result = {"leader_runs": runs, "leader_goals": leader_goals(runs), **hang_detection.handler_timing(a.ranks)}
    if base:
        result["baseline"] = {"tree": str(a.baseline_tree), "leader_runs": base}
    if pinned:
        result["pinned"] = {
            "cores": "leader on one core, load generator on another",
            "leader_runs": pinned,
            "leader_goals": leader_goals(pinned),
        }
    for key in ("leader_ingest_seconds_p99", "leader_rss_bytes", "hang_named_seconds"):
        result[f"{key}_worst"] = max(r[key] for r in runs)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=float, default=12.0, help="leader: seconds of healthy digests before the hang")
    p.add_argument("--connections", type=int, default=64, help="leader: keep-alive connections of the digest load")
    p.add_argument("--runs", type=int, default=3, help="leader: independent runs, each on a fresh leader")
    p.add_argument(
        "--scrape-seconds", type=float, default=0.0, help="leader: scrape its /metrics this often (0: never)"
    )
    p.add_argument("--leader-only", action="store_true", help="skip rank 0's boundary (simulating N collectors)")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="leader: a checkout without issue 43's checks; each run is followed by one on a leader of it",
    )
    p.add_argument(
        "--pinned",
        action="store_true",
        help="leader: each run followed by one with the leader on one core and the load generator on another",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"))
    a = p.parse_args()
    if a.ranks % (a.tp * a.pp):
        p.error(f"--ranks={a.ranks} must be a multiple of tp*pp={a.tp * a.pp}")
    result = {"ranks": a.ranks, "tp": a.tp, "pp": a.pp, "dp": a.ranks // (a.tp * a.pp)}
    if not a.leader_only:
        result.update(rank0_boundary(a))
    result.update(leader(a))
    rows = [
        [k, f"{v * 1e3:.3f} ms" if isinstance(v, float) and ("_seconds_p" in k or k.endswith("_max")) else v]
        for k, v in result.items()
        if k not in ("leader_runs", "leader_goals", "baseline", "pinned")
    ]
    for name, runs in (
        ("", result["leader_runs"]),
        ("baseline ", (result.get("baseline") or {}).get("leader_runs")),
        ("pinned ", (result.get("pinned") or {}).get("leader_runs")),
    ):
        if runs:
            p99 = " | ".join(f"{r['leader_ingest_seconds_p99'] * 1e3:.1f}" for r in runs)
            rows.append([f"{name}leader ingest p99 per run (ms)", p99])
    print_table(["measure", "value"], rows)

    def met(goals: dict) -> str:
        return ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, (_, ok) in goals.items())

    print(f"leader goals met in every run ({a.runs}): {met(result['leader_goals'])}")
    if "pinned" in result:
        print(f"pinned (leader on its own core), met in every run: {met(result['pinned']['leader_goals'])}")
    write_json(a.out, {"results": result})


if __name__ == "__main__":
    main()
