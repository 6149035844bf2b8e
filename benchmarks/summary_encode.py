"""The collector's side of the wire: one step summary encoded for summaries.jsonl and /v1/ingest on the
shipper's thread, as it is now (the StepSummary record the training thread built, encoded) and as it was
(a dict made the record with msgspec.convert, then encoded), side by side in one process.

    python benchmarks/summary_encode.py [--runs 3] [--seconds 1.0] [--out benchmarks/results/summary_encode.json]

The summaries come from real collectors (tests/unit/test_collector_sim.py: a 2-stage GPipe run with TP and
DP collectives): rank 0's, which carries the global view, and rank 1's. Figure: microseconds per summary,
each run the mean over a loop of --seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from common import cpu_jiffies, print_table, stolen_share, write_json  # noqa: E402
from test_collector_sim import pipeline, run_steps  # noqa: E402

from parwatch.wire.codec import encode  # noqa: E402
from parwatch.wire.steps import StepSummary  # noqa: E402


def converted(built: dict) -> bytes:
    """The path before: the dict the training thread built, made the record, then encoded."""
    return encode(msgspec.convert(built, StepSummary))


def summaries() -> dict[str, StepSummary]:
    run = pipeline(p=2, m=4)
    last: dict[int, tuple] = {}
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_summary = lambda s, delivery=None, view=None, r=r: last.__setitem__(r, (s, view))
    run_steps(run, 4, 0.1, dp_sync=0.004, tp_allreduce=0.001)
    prepared = [rank.collector._prepare(*last[r]) for r, rank in enumerate(run.ranks)]  # the shipper's part
    return {"rank 0 (global view)": prepared[0], "rank 1": prepared[1]}


def per_encode_us(fn, summary, seconds: float) -> float:
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
    records = summaries()
    bodies = {
        "record encoded (now)": (encode, records),
        "dict converted, then encoded (before)": (converted, {k: msgspec.to_builtins(s) for k, s in records.items()}),
    }
    for summary in records.values():  # the same bytes either way
        assert converted(msgspec.to_builtins(summary)) == encode(summary)
    before = cpu_jiffies()
    figures: dict[str, dict[str, list[float]]] = {path: {body: [] for body in records} for path in bodies}
    for _ in range(args.runs):  # interleaved, so a noisy moment hits both alike
        for path, (fn, inputs) in bodies.items():
            for body, summary in inputs.items():
                figures[path][body].append(per_encode_us(fn, summary, args.seconds))
    stolen = stolen_share(before, cpu_jiffies())
    sizes = {body: len(encode(s)) for body, s in records.items()}
    print(f"us per summary on the shipper's thread; {', '.join(f'{b} {n} B' for b, n in sizes.items())}")
    print(f"{args.runs} runs of {args.seconds:g} s each; CPU stolen by the host: {stolen:.1%}\n")
    rows = [
        [path, body, " / ".join(f"{x:.1f}" for x in runs), statistics.median(runs)]
        for path, per_body in figures.items()
        for body, runs in per_body.items()
    ]
    print_table(["path", "summary", "us (runs)", "median"], rows)
    write_json(args.out, {"bytes": sizes, "seconds_per_run": args.seconds, "stolen_cpu_share": stolen, "us": figures})


if __name__ == "__main__":
    main()
