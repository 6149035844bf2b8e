"""What rank 0's bubble-cause split costs per step (collector.causes.CauseSplitter.add_causes).

    python benchmarks/cause_split.py [--steps 30]

The split replays the run's schedule twice a step on the collector's shipper thread, which holds
the interpreter lock the training thread needs. Timed here in one process, per shape: torch's own
action lists (as the integration hands them over), every stage reporting, mean over --steps calls.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

from common import ROOT, print_table, write_json

sys.path.insert(0, str(ROOT))

SHAPES = (("1F1B", 2, 8, 1), ("Interleaved1F1B", 2, 8, 2), ("ZBVZeroBubble", 2, 8, 2), ("Interleaved1F1B", 16, 32, 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/cause_split.json")
    a = ap.parse_args()

    from parwatch import pipeline_sim as ps
    from parwatch.collector.causes import CauseSplitter
    from tests.torch_orders import torch_order

    rows, results = [], []
    for name, p, m, v in SHAPES:
        order = ps.single_stage_order("1f1b", p, m) if name == "1F1B" else torch_order(name, p, m, v)
        splitter = CauseSplitter()
        splitter.set_order({r: [None if x is None else str(x) for x in acts] for r, acts in order.items()})
        stage = {
            "bubble_ratio": 0.1,
            "forward_seconds": 0.04,
            "backward_seconds": 0.08,
            "backward_weight_seconds": 0.02 if name == "ZBVZeroBubble" else 0.0,
        }
        summary = {"global": {"stages": [{"stage": s, **stage} for s in range(p)]}}
        times = []
        for _ in range(a.steps):
            copied = copy.deepcopy(summary)
            t0 = time.perf_counter()
            splitter.add_causes(copied)
            times.append(time.perf_counter() - t0)
        if splitter.errors or "bubble_wait_ratio" not in copied["global"]["stages"][0]:
            raise SystemExit(f"{name}: the split did not run ({splitter.errors} errors)")
        actions = sum(len(acts) for acts in ps.normalize(order).values())
        rows.append([f"{name} p={p} m={m} v={v}", actions, statistics.mean(times) * 1e3])
        results.append(
            {
                "schedule": name,
                "p": p,
                "m": m,
                "v": v,
                "actions": actions,
                "mean_ms": statistics.mean(times) * 1e3,
                "steps": a.steps,
            }
        )
    print_table(["shape", "compute actions", "add_causes per step (ms, mean)"], rows)
    write_json(a.out, {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
