"""The collector's side of the wire: one step summary encoded for summaries.jsonl and /v1/ingest, as its
record (collector/wire.py: encode_summary, StepSummary) and as the json.dumps of the dict it replaced,
side by side in one process.

    python benchmarks/summary_encode.py [--runs 3] [--seconds 1.0] [--out benchmarks/results/summary_encode.json]

The summaries come from real collectors (tests/unit/test_collector_sim.py: a 2-stage GPipe run with TP and
DP collectives): rank 0's, which carries the global view, and rank 1's. Figure: microseconds per summary,
each run the mean over a loop of --seconds. Both run on the shipper's thread, never the training thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from common import cpu_jiffies, print_table, stolen_share, write_json  # noqa: E402
from test_collector_sim import pipeline, run_steps  # noqa: E402

from parwatch.collector.wire import dumps as as_dict  # noqa: E402  (what the shipper sent before)
from parwatch.collector.wire import encode_summary  # noqa: E402

ENCODERS = {"StepSummary record (chosen)": encode_summary, "json.dumps of the dict": as_dict}


def summaries() -> dict[str, dict]:
    run = pipeline(p=2, m=4)
    last: dict[int, dict] = {}
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_summary = lambda s, delivery=None, r=r: last.__setitem__(r, s)
    run_steps(run, 4, 0.1, dp_sync=0.004, tp_allreduce=0.001)
    for r, rank in enumerate(run.ranks):
        rank.collector._prepare(last[r])  # the shipper thread's part, before it encodes
    return {"rank 0 (global view)": last[0], "rank 1": last[1]}


def per_encode_us(fn, summary: dict, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(200):
            fn(summary)
        n += 200
    return elapsed / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="length of one timed loop")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "summary_encode.json"))
    args = p.parse_args()
    bodies = summaries()
    for summary in bodies.values():  # the same content either way (the record adds only nulls)
        sent, built = json.loads(encode_summary(summary)), json.loads(as_dict(summary))
        assert all(sent[k] == v for k, v in built.items() if not isinstance(v, dict)), "the record lost a figure"
    before = cpu_jiffies()
    figures = {enc: {body: [] for body in bodies} for enc in ENCODERS}
    for _ in range(args.runs):  # interleaved, so a noisy moment hits both alike
        for enc, fn in ENCODERS.items():
            for body, summary in bodies.items():
                figures[enc][body].append(per_encode_us(fn, summary, args.seconds))
    stolen = stolen_share(before, cpu_jiffies())
    sizes = {body: len(encode_summary(s)) for body, s in bodies.items()}
    print(f"us per summary encoded; {', '.join(f'{b} {n} B' for b, n in sizes.items())}")
    print(f"{args.runs} runs of {args.seconds:g} s each; CPU stolen by the host: {stolen:.1%}\n")
    rows = [
        [enc, body, " / ".join(f"{x:.1f}" for x in runs), statistics.median(runs)]
        for enc, per_body in figures.items()
        for body, runs in per_body.items()
    ]
    print_table(["encoder", "summary", "us (runs)", "median"], rows)
    write_json(args.out, {"bytes": sizes, "seconds_per_run": args.seconds, "stolen_cpu_share": stolen, "us": figures})


if __name__ == "__main__":
    main()
