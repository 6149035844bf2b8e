"""Hostile-input benchmark: one real `parwatch sidecar` under the worst input it accepts and floods of
input it must refuse (issue 11).

Measured:
  1. /healthz latency (control and metrics listeners, p50/p99/max) while the worst accepted ingest
     -- one post of N rank-0 summaries whose loss flips between finite and NaN every step, so the
     `nonfinite-loss` rule changes state at every step -- is processed, and a /metrics scrape runs.
  2. The sidecar's RSS after a flood of hostile summaries (default 100,000): new run ids, ranks of
     claimed worlds, numbers beyond what a metric can hold, unknown groups, retries in any order.
     Every answer must be a 200 or a 4xx; /metrics must still answer 200.

    python benchmarks/sidecar_hostile.py --worst 10000 --hostile 100000 --out benchmarks/results/sidecar_hostile.json

Goals: /healthz p99 <= 100 ms during the worst ingest; RSS <= 300 MB after the flood; no 5xx.
Run it on an otherwise idle machine: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import write_json  # noqa: E402

from benchmarks.sidecar_load import percentile, rss_mb  # noqa: E402
from tests.fixtures import synthetic as syn  # noqa: E402
from tests.sidecar_process import running_sidecar  # noqa: E402

GOALS = {"healthz_p99_ms": 100.0, "rss_mb": 300.0}


def minimal(rank: int, step: int, **kw) -> dict:
    """A valid summary without the optional blocks (GPU, collectives): the most summaries per body."""
    s = syn.summary(rank, step, gpu=False, **kw)
    for key in (
        "collectives",
        "instances",
        "gpu",
        "checkpoints",
        "tp_rank",
        "dp_rank",
        "chunks",
        "other_seconds",
        "memory_max_allocated_bytes",
        "nvml_up",
        "overhead_seconds",
        "dropped_total",
        "paused",
        "tokens",
        "time_seconds",
    ):
        s.pop(key, None)  # all optional
    return s


def worst_body(n: int) -> bytes:
    """n rank-0 summaries of one run, steps 1..n, the global loss NaN on every other step."""
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    summaries = [
        minimal(0, step, run_id="worst", global_stages=stages, global_loss=float("nan") if step % 2 else 2.0)
        for step in range(1, n + 1)
    ]
    return json.dumps({"version": 1, "summaries": summaries}).encode()


def _hostile_summary(rng: random.Random, i: int) -> dict:
    """One of the shapes a confused or malicious client sends."""
    kind = i % 8
    if kind == 0:  # a new run id every time: run-id churn
        return minimal(0, 1, run_id=f"run-{i}")
    if kind == 1:  # a huge claimed world, ranks all over it (cardinality)
        return minimal(rng.randrange(8 * 64 * 64), 1, run_id="big", tp=8, pp=64, dp=64)
    if kind == 2:  # the same run with another world
        return minimal(1, 1, run_id="big", tp=2, pp=2, dp=1)
    if kind == 3:  # numbers beyond float precision or range
        s = minimal(0, 1, run_id="big", tp=8, pp=64, dp=64)
        s[rng.choice(["tokens", "dropped_total", "step", "memory_max_allocated_bytes"])] = 10**400
        return s
    if kind == 4:  # unknown group names (label cardinality)
        s = minimal(0, 1, run_id="big", tp=8, pp=64, dp=64)
        s["collectives"] = [syn.collective("all_reduce", f"g{i}", 1, 0.001, 1024, 2)]
        return s
    if kind == 5:  # retries of one step in any order, with any clock
        return minimal(
            rng.randrange(64), rng.randrange(1, 4), run_id="big", tp=8, pp=64, dp=64, time=rng.uniform(0, 1e10)
        )
    if kind == 6:  # control characters in the run id (log forging)
        return minimal(0, 1, run_id=f"run\nERROR forged {i}")
    return minimal(rng.randrange(8 * 64 * 64), rng.randrange(1, 10**6), run_id="big", tp=8, pp=64, dp=64)


def flood(control_url: str, headers: dict, n: int, per_post: int = 200, seed: int = 11) -> Counter:
    """Post n hostile summaries, per_post at a time (and each shape alone, so one bad summary does
    not hide the others); returns the count of each HTTP status."""
    rng = random.Random(seed)
    statuses: Counter = Counter()
    with httpx.Client(timeout=60, headers=headers) as client:
        for start in range(0, n, per_post):
            batch = [_hostile_summary(rng, i) for i in range(start, min(n, start + per_post))]
            # One post per shape keeps most posts acceptable-looking; posts mixing runs are refused whole.
            by_kind: dict[int, list] = {}
            for i, s in enumerate(batch):
                by_kind.setdefault((start + i) % 8, []).append(s)
            for summaries in by_kind.values():
                r = client.post(f"{control_url}/v1/ingest", json={"version": 1, "summaries": summaries})
                statuses[r.status_code] += 1
    return statuses


def run(worst: int, hostile: int, probe_interval: float = 0.005) -> dict:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        with running_sidecar(Path(tmp) / "state", "--log-level", "warning") as sp:
            body = worst_body(worst)
            # 1. The worst accepted ingest, with both listeners probed and a scrape under way.
            results = ctx.Queue()
            deadline_file = Path(tmp) / "done"
            probers = [
                ctx.Process(
                    target=_probe_until_file,
                    args=(f"{url}/healthz", deadline_file, probe_interval, results),
                    daemon=True,
                )
                for url in (sp.control_url, sp.metrics_url)
            ]
            for p in probers:
                p.start()
            time.sleep(1.0)  # the probers' baseline
            with httpx.Client(timeout=600, headers=sp.headers) as client:
                t0 = time.monotonic()
                r = client.post(
                    f"{sp.control_url}/v1/ingest", content=body, headers={"content-type": "application/json"}
                )
                ingest_seconds = time.monotonic() - t0
                ingest_status = r.status_code
                t1 = time.monotonic()
                scrape = client.get(f"{sp.metrics_url}/metrics")
                scrape_seconds = time.monotonic() - t1
            time.sleep(0.5)
            deadline_file.write_text("")
            probes = [results.get(timeout=60) for _ in probers]
            for p in probers:
                p.join(10)
            during = [[d for started, d in times if t0 <= started <= t0 + ingest_seconds] for times in probes]
            # 2. The flood.
            rss_before = rss_mb(sp.pid)
            f0 = time.monotonic()
            statuses = flood(sp.control_url, sp.headers, hostile)
            flood_seconds = time.monotonic() - f0
            rss_after = rss_mb(sp.pid)
            after = httpx.get(f"{sp.metrics_url}/metrics", timeout=60)
            status = httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=60).json()
            log_lines = sp.log().splitlines()
    return {
        "worst_summaries": worst,
        "worst_body_bytes": len(body),
        "worst_ingest_status": ingest_status,
        "worst_ingest_seconds": ingest_seconds,
        "healthz_control_ms_p50": percentile(during[0], 50) * 1e3,
        "healthz_control_ms_p99": percentile(during[0], 99) * 1e3,
        "healthz_control_ms_max": max(during[0], default=float("nan")) * 1e3,
        "healthz_metrics_ms_p99": percentile(during[1], 99) * 1e3,
        "healthz_probes_during": [len(d) for d in during],
        "scrape_after_worst_ms": scrape_seconds * 1e3,
        "scrape_after_worst_status": scrape.status_code,
        "hostile_summaries": hostile,
        "hostile_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "hostile_seconds": flood_seconds,
        "rss_mb_before_flood": rss_before,
        "rss_mb_after_flood": rss_after,
        "metrics_after_flood_status": after.status_code,
        "metrics_after_flood_bytes": len(after.content),
        "ranks_held": len(status["ranks"]),
        "forged_log_lines": sum("ERROR forged" in line for line in log_lines),
    }


def _probe_until_file(url: str, stop_file: Path, interval: float, out) -> None:
    """GET url every `interval` s until stop_file exists; puts [(started, seconds)] (monotonic clock)."""
    times = []
    with httpx.Client(timeout=30) as client:
        while not stop_file.exists():
            t0 = time.monotonic()
            client.get(url).raise_for_status()
            times.append((t0, time.monotonic() - t0))
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    out.put(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worst", type=int, default=10_000, help="summaries in the worst accepted ingest")
    p.add_argument("--hostile", type=int, default=100_000, help="hostile summaries in the flood")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sidecar_hostile.json"))
    args = p.parse_args(argv)
    result = run(args.worst, args.hostile)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()}
    five_xx = sum(v for k, v in result["hostile_statuses"].items() if k.startswith("5"))
    result["goals"] = {
        "healthz_p99_ms": [
            GOALS["healthz_p99_ms"],
            max(result["healthz_control_ms_p99"], result["healthz_metrics_ms_p99"]) <= GOALS["healthz_p99_ms"],
        ],
        "rss_mb": [GOALS["rss_mb"], result["rss_mb_after_flood"] <= GOALS["rss_mb"]],
        "no_5xx": [
            0,
            five_xx == 0 and result["worst_ingest_status"] == 200 and result["metrics_after_flood_status"] == 200,
        ],
    }
    rows = [
        (
            "worst ingest: summaries, bytes, status, seconds",
            f"{args.worst}, {result['worst_body_bytes']}, {result['worst_ingest_status']}, "
            f"{result['worst_ingest_seconds']:.2f}",
            "",
        ),
        (
            "/healthz during it: control p50 / p99 / max (ms)",
            f"{result['healthz_control_ms_p50']:.1f} / {result['healthz_control_ms_p99']:.1f} / "
            f"{result['healthz_control_ms_max']:.1f}",
            "p99 <= 100",
        ),
        ("/healthz during it: metrics listener p99 (ms)", f"{result['healthz_metrics_ms_p99']:.1f}", "p99 <= 100"),
        ("scrape right after it (ms)", f"{result['scrape_after_worst_ms']:.0f}", ""),
        ("hostile flood: summaries, seconds", f"{args.hostile}, {result['hostile_seconds']:.1f}", ""),
        ("hostile flood: answers by status", json.dumps(result["hostile_statuses"]), "no 5xx"),
        (
            "RSS before / after the flood (MB)",
            f"{result['rss_mb_before_flood']:.0f} / {result['rss_mb_after_flood']:.0f}",
            "<= 300",
        ),
        (
            "/metrics after the flood: status, bytes",
            f"{result['metrics_after_flood_status']}, {result['metrics_after_flood_bytes']}",
            "200",
        ),
        ("ranks held, forged log lines", f"{result['ranks_held']}, {result['forged_log_lines']}", "0 forged"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"sidecar hostile input, load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, value, goal in rows:
        print(f"  {name:<{width}}  {value:<30} {goal}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
