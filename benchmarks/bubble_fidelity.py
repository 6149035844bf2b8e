"""Measured bubble per stage against the schedule's formula, under synthetic compute.

    python benchmarks/bubble_fidelity.py [--fwd-ms 40 --bwd-ms 80 --steps 6]

For GPipe and 1F1B, p in {2, 4}, m in {1, 2, 4, 8}: run the trainer with the
collector on and --synthetic-compute, read every stage's bubble (parwatch.bubble's,
over the steps after the first) from --summary-json, and compare with (p-1)/(m+p-1).
Goal: |measured - formula| <= 0.02 on every stage.
"""

from __future__ import annotations

import argparse
import sys

from common import ROOT, print_table, run_trainer, write_json

sys.path.insert(0, str(ROOT))

from parwatch.bubble import theoretical  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fwd-ms", type=float, default=40.0)
    ap.add_argument("--bwd-ms", type=float, default=80.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--out", default="benchmarks/results/bubble_fidelity.json")
    a = ap.parse_args()
    rows, results = [], []
    for schedule in a.schedules.split(","):
        for p in map(int, a.pp.split(",")):
            for m in map(int, a.microbatches.split(",")):
                s = run_trainer(
                    [
                        "--nproc",
                        str(p),
                        "--pp",
                        str(p),
                        "--schedule",
                        schedule,
                        "--microbatches",
                        str(m),
                        "--steps",
                        str(a.steps),
                        "--layers",
                        str(p),
                        "--hidden",
                        "32",
                        "--seq-len",
                        "16",
                        "--synthetic-compute",
                        f"fwd_ms={a.fwd_ms:g},bwd_ms={a.bwd_ms:g}",
                        "--parwatch",
                        "on",
                    ]
                )
                theory = theoretical(schedule, p, m)
                measured = [st["bubble_ratio"] for st in s["stages"]]
                worst = max(abs(b - theory) for b in measured)
                ok = worst <= a.tolerance
                rows.append(
                    [schedule, p, m, theory, " ".join(f"{b:.4f}" for b in measured), worst, "ok" if ok else "FAIL"]
                )
                results.append(
                    {
                        "schedule": schedule,
                        "pp": p,
                        "microbatches": m,
                        "theory": theory,
                        "measured": measured,
                        "max_abs_error": worst,
                        "within_tolerance": ok,
                        "pipeline_skew_ratio": s["pipeline_skew_ratio"],
                    }
                )
                print(f"{schedule} p={p} m={m}: theory {theory:.4f} measured {measured}", flush=True)
    print()
    print_table(["schedule", "p", "m", "formula", "measured per stage", "max |err|", ""], rows)
    worst = max(r["max_abs_error"] for r in results)
    print(f"\nworst |measured - formula| = {worst:.4f} (goal <= {a.tolerance})")
    write_json(
        a.out,
        {
            "fwd_ms": a.fwd_ms,
            "bwd_ms": a.bwd_ms,
            "steps": a.steps,
            "tolerance": a.tolerance,
            "results": results,
            "worst_abs_error": worst,
        },
    )
    return 0 if all(r["within_tolerance"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
