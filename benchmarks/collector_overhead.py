"""What the collector costs: median step time with it on over off, runs alternated in one go.

    python benchmarks/collector_overhead.py [--rounds 4 --steps 16]

Two workloads: the real-compute TP2 x PP2 GPT, and PP2 under synthetic compute.
Each round runs the same configuration with --parwatch off, then on (order
alternating between rounds, so drift in the machine's load hits both). The
ratio compares the medians of all steps after the first three of every run.
Goal: on/off <= 1.01. Also reported: the collector's own accounting of its time
on the training thread (overhead_seconds / step_seconds, from its summaries).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import print_table, run_trainer, write_json

WORKLOADS = {
    "real TP2xPP2 GPT (h=256, 8 layers, s=64, m=8)": [
        "--nproc",
        "4",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "8",
        "--layers",
        "8",
        "--hidden",
        "256",
        "--heads",
        "8",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "4",
        "--vocab",
        "512",
    ],
    "synthetic PP2 (fwd 20 ms, bwd 40 ms, m=4)": [
        "--nproc",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--seq-len",
        "16",
        "--synthetic-compute",
        "fwd_ms=20,bwd_ms=40",
    ],
}
WARMUP = 3


def self_reported(log_dir: str) -> float | None:
    ratios = []
    path = Path(log_dir) / "summaries.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if s["step"] > WARMUP and s["step_seconds"] > 0:
            ratios.append(s["overhead_seconds"] / s["step_seconds"])
    return statistics.median(ratios) if ratios else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/collector_overhead.json")
    a = ap.parse_args()
    rows, results = [], []
    for name, args in WORKLOADS.items():
        times = {"off": [], "on": []}
        own = []
        for r in range(a.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                with tempfile.TemporaryDirectory() as log_dir:
                    extra = ["--parwatch", mode] + (["--parwatch-log", log_dir] if mode == "on" else [])
                    s = run_trainer([*args, "--steps", str(a.steps), *extra])
                    if mode == "on":
                        own.append(self_reported(log_dir))
                times[mode] += s["step_seconds"][WARMUP:]
            print(f"{name}: round {r + 1}/{a.rounds} done", flush=True)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        own_ratio = statistics.median([o for o in own if o is not None]) if any(own) else None
        rows.append([name, off, on, on / off, own_ratio])
        results.append(
            {
                "workload": name,
                "median_step_off_s": off,
                "median_step_on_s": on,
                "ratio": on / off,
                "collector_self_reported_ratio": own_ratio,
                "steps_per_mode": len(times["on"]),
            }
        )
    print()
    print_table(["workload", "median step off (s)", "on (s)", "on/off", "collector's own time / step"], rows)
    write_json(a.out, {"rounds": a.rounds, "steps": a.steps, "warmup_steps_dropped": WARMUP, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
