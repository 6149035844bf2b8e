"""What the torch pipelining integration costs: median step time with it on over off, in one process.

    python benchmarks/integration_overhead.py [--rounds 6 --steps 8] [--fidelity]

Two gloo ranks build one torch.distributed.pipelining schedule (examples/torch_pipelining.py's
synthetic stages) and then alternate, between steps, blocks of `--steps` steps with the
integration attached (PipelineWatch wrappers, a Collector on the registry, the step-boundary
all-reduce after every step) and detached (the schedule exactly as torch ships it, no
boundary). Block order alternates between rounds, so drift in the machine's load hits both;
the first two steps of every block are dropped (the switch itself). Goal: on/off <= 1.01.
Also reported: the step boundary's own cost (the least `step_done` time: the all-reduce when
no rank waits for another's flush).

--fidelity adds the bubble table: every schedule class at 40/80 ms per virtual stage, each
rank's measured bubble (median and least disturbed step) against the replay of the
schedule's own action lists at the measured action times, and the closed form where there is
one. Run it on a quiet machine: load only ever adds idle.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

from common import ROOT, print_table, write_json

sys.path.insert(0, str(ROOT))

from tests.distutil import run_ranks  # noqa: E402

WORKLOADS = {  # name -> example argv
    "1f1b p=2 m=8, 5/10 ms": ["--schedule", "1f1b", "--microbatches", "8", "--synthetic-ms", "5,10"],
    "zbv p=2 m=8, 5/10 ms (F, I, W split)": ["--schedule", "zbv", "--microbatches", "8", "--synthetic-ms", "5,10"],
    "interleaved1f1b p=2 m=8 v=2, 5/10 ms": ["--schedule", "interleaved1f1b", "--microbatches", "8",
                                             "--synthetic-ms", "5,10"],
}
DROP = 2  # steps dropped at the start of every block


def _example():
    spec = importlib.util.spec_from_file_location("torch_pipelining_example",
                                                  os.path.join(ROOT, "examples", "torch_pipelining.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alternate(rank: int, world: int, argv: list, rounds: int, steps: int, log_dir: str) -> dict:
    """Every rank: one schedule, blocks of steps with the integration on and off."""
    import torch.distributed as dist

    from parwatch.collector import Collector, attach, detach
    from parwatch.integrations.torch_pipelining import PipelineWatch

    example = _example()
    args = example.parse_args(argv)
    schedule, _, optimizer = example.build(args, rank, world)
    watch = PipelineWatch(schedule, run_id="overhead")
    collector = Collector(watch.run_context(), log_path=os.path.join(log_dir, "summaries.jsonl"))
    times = {"on": [], "off": []}
    boundary = []
    step = 0
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if mode == "on":
                watch.attach()
                attach(collector)
                watch.start(step)
            else:
                watch.detach()
                detach(collector)
            for i in range(steps):
                x, y = example.batch(args, step + 1)
                t0 = time.perf_counter()
                optimizer.zero_grad()
                schedule.step(x, target=y)
                if mode == "on":
                    watch.optimizer_step(optimizer)
                    t1 = time.perf_counter()
                    step = watch.step_done()
                    if i >= DROP:
                        boundary.append(time.perf_counter() - t1)
                else:
                    optimizer.step()
                    step += 1
                if i >= DROP:
                    times[mode].append(time.perf_counter() - t0)
        dist.barrier()
    watch.close()
    collector.close()
    return {"times": times, "boundary": boundary}


def overhead(rounds: int, steps: int, only: str = "") -> tuple[list, list]:
    rows, results = [], []
    for name, argv in WORKLOADS.items():
        if only not in name:
            continue
        with tempfile.TemporaryDirectory() as log_dir:
            per_rank = run_ranks(alternate, 2, argv, rounds, steps, log_dir, timeout=600)
        # A step's time is the slower rank's: the pipeline waits for it anyway.
        on = statistics.median(max(ts) for ts in zip(*(r["times"]["on"] for r in per_rank)))
        off = statistics.median(max(ts) for ts in zip(*(r["times"]["off"] for r in per_rank)))
        # step_done's time includes waiting for the other rank's flush; its least is the all-reduce's own.
        bnd = min(b for r in per_rank for b in r["boundary"])
        rows.append([name, off, on, on / off, bnd])
        results.append({"workload": name, "median_step_off_s": off, "median_step_on_s": on, "ratio": on / off,
                        "least_step_done_s": bnd, "steps_per_mode": len(per_rank[0]["times"]["on"])})
        print(f"{name}: done", flush=True)
    return rows, results


def fidelity() -> tuple[list, list]:
    from parwatch import pipeline_sim as ps
    from tests.dist import test_torch_pipelining as t

    rows, results = [], []
    with tempfile.TemporaryDirectory() as out:
        runs = {s: t.run_argv(s, steps=6) for s in t.SCHEDULES}
        run_ranks(t.runs_body, t.P, runs, out, timeout=600)
        for schedule in t.SCHEDULES:
            run_dir = os.path.join(out, schedule)
            median = t.measured_bubble(run_dir, statistics.median)
            least = t.measured_bubble(run_dir, min)
            times = t.action_seconds(run_dir, lambda span, kind: (span["attrs"]["vstage"], kind))
            replay = ps.simulate(t.order_of(schedule, t.P, t.M), times).bubble
            v = 1 if schedule in ("gpipe", "1f1b") else 2
            formula = ps.theory(t.CLOSED_FORM[schedule], t.P, t.M, v) if schedule in t.CLOSED_FORM else None
            for rank in range(t.P):
                rows.append([schedule, rank, median[rank], least[rank], replay[rank],
                             median[rank] - replay[rank], "-" if formula is None else formula])
                results.append({"schedule": schedule, "rank": rank, "measured_median": median[rank],
                                "measured_least_disturbed": least[rank], "replayed": replay[rank],
                                "formula": formula})
    return rows, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="steps per block (the first 2 are dropped)")
    ap.add_argument("--only", default="", help="run the workloads whose name contains this")
    ap.add_argument("--fidelity", action="store_true", help="also the bubble-vs-replay table (every class)")
    ap.add_argument("--out", default="benchmarks/results/integration_overhead.json")
    a = ap.parse_args()
    if a.steps <= DROP:
        ap.error(f"--steps must be > {DROP} (the first {DROP} of every block are dropped)")
    rows, results = overhead(a.rounds, a.steps, a.only)
    print()
    print_table(["workload", "median step off (s)", "on (s)", "on/off", "boundary all-reduce (s, least)"], rows)
    payload = {"rounds": a.rounds, "steps_per_block": a.steps, "dropped_per_block": DROP, "results": results}
    if a.fidelity:
        frows, fresults = fidelity()
        print()
        print_table(["schedule", "rank", "bubble (median)", "(least disturbed)", "replayed", "median - replayed",
                     "formula"], frows)
        payload["fidelity"] = fresults
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
