"""What the torch pipelining integration costs: median step time with it on over off, in one process.

    python benchmarks/integration_overhead.py [--pairs 40] [--synthetic-ms 5,10] [--fidelity]

Two gloo ranks build one torch.distributed.pipelining schedule (examples/torch_pipelining.py's
synthetic stages) and then alternate step by step: one step with the integration attached
(PipelineWatch wrappers, a Collector on the registry, the step-boundary all-reduce), one
detached (the schedule exactly as torch ships it, no boundary), in pairs whose order flips
every pair, so drift in the machine's load hits both. Attaching (and the run_start boundary that
opens an attached step's period) happens between steps, outside the timing. The first pairs are
warm-up and dropped. Goal: on/off <= 1.01 (median step time; a step's time is the slower rank's).
Stages sleep 5/10 ms per microbatch forward/backward unless --synthetic-ms says otherwise; what the
integration adds is a cost per action and per step, not a share of the step, so the ratio depends on
those times (docs/benchmarks.md gives 5/10 and 20/40, the shape benchmarks/collector_overhead.py uses).
Also the paired ratio: the median over pairs of on/off within a pair (its two steps ran back to
back, so drift in the machine's speed cancels), with a distribution-free 95% interval.

Also per mode: the training thread's CPU time per step (time.thread_time: what the integration
adds on the thread that drives the pipeline, unaffected by other processes' load) and, attached,
the CPU of step_done alone (the boundary: packing, the all-reduce, the collector's summary).
Wall-clock ratios need a quiet machine (and, on a virtual machine, a quiet host: the table prints
the share of CPU the hypervisor gave other guests during each workload); the CPU figures do not.

--breakdown adds where the training thread's added CPU goes: the same on/off alternation with
"on" cut down in turn (full; the collector without its shipper thread, i.e. no log file, no
bubble-cause replay; a do-nothing observer, i.e. the integration's wrappers and the span
machinery alone; the wrappers with no observer, i.e. the registry inactive; the step-boundary
all-reduce alone, no wrappers; A/A, both modes off: the method's own noise). CPU is split into
the schedule's step (schedule.step + optimizer) and step_done.

--fidelity adds the bubble table: every schedule class at 40/80 ms per virtual stage, each
rank's measured bubble per step against the replay of the schedule's own action lists at that
step's measured action times, executor host time per action and p2p latency (the bar: 0.02),
and against the replay at the run's mean action times alone (what a quiet machine approaches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from common import ROOT, cpu_jiffies, print_table, stolen_share, two_positive, write_json

sys.path.insert(0, str(ROOT))

from tests.distutil import load_example, run_ranks  # noqa: E402

WORKLOADS = {  # name -> example argv
    "1f1b p=2 m=8, 5/10 ms": ["--schedule", "1f1b", "--microbatches", "8", "--synthetic-ms", "5,10"],
    "zbv p=2 m=8, 5/10 ms (F, I, W split)": ["--schedule", "zbv", "--microbatches", "8", "--synthetic-ms", "5,10"],
    "interleaved1f1b p=2 m=8 v=2, 5/10 ms": [
        "--schedule",
        "interleaved1f1b",
        "--microbatches",
        "8",
        "--synthetic-ms",
        "5,10",
    ],
}
WARMUP = 3  # pairs dropped at the start
VARIANTS = {  # --breakdown: what "on" keeps
    "full": "collector + shipper thread (log file, rank 0's bubble-cause replay)",
    "no_shipper": "collector, no shipper thread (no log file)",
    "null_observer": "a do-nothing observer: integration wrappers + span machinery",
    "no_observer": "integration wrappers, registry inactive (no spans)",
    "boundary_only": "the step-boundary all-reduce alone (no wrappers, no spans)",
    "a_a": "nothing: both modes run off (the method's own noise and bias)",
}


def alternate(rank: int, world: int, argv: list, pairs: int, log_dir: str, variant: str = "full") -> dict:
    """Every rank: one schedule, steps alternately with the integration on and off."""
    import torch.distributed as dist

    from parwatch.collector import Collector, attach, detach
    from parwatch.contract import Observer, registry
    from parwatch.integrations.torch_pipelining import PipelineWatch

    example = load_example("torch_pipelining")
    args = example.parse_args(argv)
    schedule, _, optimizer = example.build(args, rank, world)
    watch = PipelineWatch(schedule, run_id="overhead")
    watch.detach()
    if variant in ("full", "no_shipper"):
        collector = Collector(
            watch.run_context(), log_path=os.path.join(log_dir, "summaries.jsonl") if variant == "full" else None
        )
    else:
        collector = Observer() if variant == "null_observer" else None

        def attach(observer):  # noqa: F811  (plain registration: no collector, no clock)
            if observer is not None:
                registry.register(observer)

        def detach(observer):  # noqa: F811
            if observer is not None:
                registry.unregister(observer)

    times = {"on": [], "off": []}
    cpu = {"on": [], "off": []}
    boundary_cpu, boundary_wall, schedule_cpu = [], [], {"on": [], "off": []}
    step = 0
    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            on = mode == "on" and variant != "a_a"
            if on:
                if variant != "boundary_only":
                    watch.attach()
                    attach(collector)
                watch.start(step)  # opens the attached step's period (an all-reduce: the ranks line up)
            else:
                dist.barrier()  # the ranks line up as the start boundary makes them do when attached
            x, y = example.batch(args, step + 1)
            c0, t0 = time.thread_time(), time.perf_counter()
            optimizer.zero_grad()
            schedule.step(x, target=y)
            if on:
                watch.optimizer_step(optimizer)
                c1, t1 = time.thread_time(), time.perf_counter()
                step = watch.step_done()
            else:
                optimizer.step()
                c1 = time.thread_time()
                step += 1
            c2, t2 = time.thread_time(), time.perf_counter()
            if pair >= WARMUP:
                times[mode].append(t2 - t0)
                cpu[mode].append(c2 - c0)
                schedule_cpu[mode].append(c1 - c0)
                if mode == "on":
                    boundary_cpu.append(c2 - c1 if on else 0.0)
                    boundary_wall.append(t2 - t1 if on else 0.0)
            if on and variant != "boundary_only":
                watch.detach()
                detach(collector)
    watch.close()
    if hasattr(collector, "close"):
        collector.close()
    return {
        "times": times,
        "cpu": cpu,
        "boundary_cpu": boundary_cpu,
        "boundary_wall": boundary_wall,
        "schedule_cpu": schedule_cpu,
    }


def workloads(synthetic_ms: str = "") -> dict:
    """WORKLOADS, with every stage's F,B ms replaced by `synthetic_ms` when given."""
    if not synthetic_ms:
        return WORKLOADS
    out = {}
    for name, argv in WORKLOADS.items():
        argv = list(argv)
        argv[argv.index("--synthetic-ms") + 1] = synthetic_ms
        out[name.replace("5/10 ms", synthetic_ms.replace(",", "/") + " ms")] = argv
    return out


def overhead(pairs: int, only: str = "", synthetic_ms: str = "") -> tuple[list, list]:
    rows, results = [], []
    for name, argv in workloads(synthetic_ms).items():
        if only not in name:
            continue
        with tempfile.TemporaryDirectory() as log_dir:
            jiffies = cpu_jiffies()
            per_rank = run_ranks(alternate, 2, argv, pairs, log_dir, timeout=600)
            stolen = stolen_share(jiffies, cpu_jiffies())
        # A step's time is the slower rank's: the pipeline waits for it anyway.
        on, off = slower_rank_median(per_rank, "on"), slower_rank_median(per_rank, "off")
        cpu_on = max(statistics.median(r["cpu"]["on"]) for r in per_rank)
        cpu_off = max(statistics.median(r["cpu"]["off"]) for r in per_rank)
        bnd_cpu = max(statistics.median(r["boundary_cpu"]) for r in per_rank)
        # step_done's time includes waiting for the other rank's flush; its least is the all-reduce's own.
        bnd = min(b for r in per_rank for b in r["boundary_wall"])
        paired, low, high = paired_ratio(per_rank)
        rows.append(
            [
                name,
                off,
                on,
                on / off,
                f"{paired:.4f} [{low:.4f}, {high:.4f}]",
                cpu_off * 1e6,
                cpu_on * 1e6,
                (cpu_on - cpu_off) * 1e6,
                bnd_cpu * 1e6,
                bnd,
                f"{stolen:.0%}",
            ]
        )
        results.append(
            {
                "workload": name,
                "median_step_off_s": off,
                "median_step_on_s": on,
                "ratio": on / off,
                "paired_ratio_median": paired,
                "paired_ratio_95ci": [low, high],
                "step_off_s": slower_rank_steps(per_rank, "off"),
                "step_on_s": slower_rank_steps(per_rank, "on"),
                "thread_cpu_per_step_off_us": cpu_off * 1e6,
                "thread_cpu_per_step_on_us": cpu_on * 1e6,
                "step_done_thread_cpu_us": bnd_cpu * 1e6,
                "least_step_done_s": bnd,
                "steps_per_mode": len(per_rank[0]["times"]["on"]),
                "cpu_stolen_share": stolen,
            }
        )
        print(f"{name}: done", flush=True)
    return rows, results


def slower_rank_steps(per_rank: list, mode: str) -> list:
    """Each step's time of the slower rank (the pipeline waits for it anyway), in pair order."""
    return [max(ts) for ts in zip(*(r["times"][mode] for r in per_rank))]


def slower_rank_median(per_rank: list, mode: str) -> float:
    return statistics.median(slower_rank_steps(per_rank, mode))


def paired_ratio(per_rank: list) -> tuple[float, float, float]:
    """Median over pairs of on/off within the pair (its two steps ran back to back, so slow drift
    in the machine's speed cancels), with a distribution-free 95% interval for that median
    (order statistics n/2 -+ 0.98 sqrt(n))."""
    ratios = sorted(on / off for on, off in zip(slower_rank_steps(per_rank, "on"), slower_rank_steps(per_rank, "off")))
    n = len(ratios)
    k = max(0, int((n - 1.96 * n**0.5) / 2))
    return statistics.median(ratios), ratios[k], ratios[n - 1 - k]


def breakdown(pairs: int, only: str = "", synthetic_ms: str = "") -> tuple[list, list]:
    """Each variant of "on" against off, alternated in one process (see VARIANTS)."""
    rows, results = [], []
    for name, argv in workloads(synthetic_ms).items():
        if only not in name:
            continue
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory() as log_dir:
                per_rank = run_ranks(alternate, 2, argv, pairs, log_dir, variant, timeout=600)
            # Per rank: median on - median off of the schedule's CPU; the larger rank's.
            added = max(
                statistics.median(r["schedule_cpu"]["on"]) - statistics.median(r["schedule_cpu"]["off"])
                for r in per_rank
            )
            bnd_cpu = max(statistics.median(r["boundary_cpu"]) for r in per_rank)
            ratio = slower_rank_median(per_rank, "on") / slower_rank_median(per_rank, "off")
            paired, low, high = paired_ratio(per_rank)
            rows.append(
                [
                    name,
                    variant,
                    ratio,
                    f"{paired:.4f} [{low:.4f}, {high:.4f}]",
                    added * 1e6,
                    bnd_cpu * 1e6,
                    (added + bnd_cpu) * 1e6,
                ]
            )
            results.append(
                {
                    "workload": name,
                    "variant": variant,
                    "what_on_keeps": VARIANTS[variant],
                    "wall_ratio": ratio,
                    "paired_ratio_median": paired,
                    "paired_ratio_95ci": [low, high],
                    "schedule_thread_cpu_added_us": added * 1e6,
                    "step_done_thread_cpu_us": bnd_cpu * 1e6,
                    "per_rank": [
                        {
                            "schedule_cpu_on_s": r["schedule_cpu"]["on"],
                            "schedule_cpu_off_s": r["schedule_cpu"]["off"],
                            "step_done_cpu_s": r["boundary_cpu"],
                        }
                        for r in per_rank
                    ],
                }
            )
            print(f"{name} / {variant}: done", flush=True)
    return rows, results


def fidelity() -> tuple[list, list]:
    from parwatch import pipeline_sim as ps
    from parwatch.bubble import theoretical
    from tests.dist import test_torch_pipelining as t  # replayed_steps: tests/bubble_replay.py

    rows, results = [], []
    with tempfile.TemporaryDirectory() as out:
        runs = {s: t.run_argv(s, steps=6) for s in t.SCHEDULES}
        run_ranks(t.runs_body, t.P, runs, out, timeout=600)
        for schedule in t.SCHEDULES:
            run_dir = os.path.join(out, schedule)
            order = t.order_of(schedule, t.P, t.M)
            steps = t.replayed_steps(run_dir, order)
            times = t.action_seconds(run_dir, lambda span, kind: (span["attrs"]["vstage"], kind))
            mean_replay = ps.simulate(order, times).bubble
            v = 1 if schedule in ("gpipe", "1f1b") else 2
            formula = theoretical(t.CLOSED_FORM[schedule], t.P, t.M, v) if schedule in t.CLOSED_FORM else None
            for rank in range(t.P):
                deviations = [measured[rank] - replay.bubble[rank] for measured, replay, _, _ in steps.values()]
                plain = [measured[rank] - mean_replay[rank] for measured, _, _, _ in steps.values()]
                host = statistics.median(h[rank] for _, _, h, _ in steps.values())
                rows.append(
                    [
                        schedule,
                        rank,
                        min(deviations),
                        statistics.median(deviations),
                        max(deviations),
                        statistics.median(plain),
                        host * 1e3,
                        "-" if formula is None else formula,
                    ]
                )
                results.append(
                    {
                        "schedule": schedule,
                        "rank": rank,
                        "deviation_per_step": deviations,
                        "deviation_from_mean_time_replay_per_step": plain,
                        "host_s_per_action_median": host,
                        "formula": formula,
                    }
                )
    return rows, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40, help=f"on/off step pairs (the first {WARMUP} are dropped)")
    ap.add_argument("--only", default="", help="run the workloads whose name contains this")
    ap.add_argument(
        "--synthetic-ms",
        default="",
        help="F,B: every stage's forward/backward ms per microbatch instead of 5,10 (the added cost is "
        "mostly fixed per action and per step, so the ratio falls as they grow)",
    )
    ap.add_argument(
        "--breakdown", action="store_true", help="also the added CPU per component (on cut down in turn, see VARIANTS)"
    )
    ap.add_argument("--fidelity", action="store_true", help="also the bubble-vs-replay table (every class)")
    ap.add_argument("--out", default="benchmarks/results/integration_overhead.json")
    a = ap.parse_args()
    if a.pairs <= WARMUP:
        ap.error(f"--pairs must be > {WARMUP} (the first {WARMUP} are dropped)")
    if a.synthetic_ms and not two_positive(a.synthetic_ms):
        ap.error(f"--synthetic-ms {a.synthetic_ms!r}: give forward,backward ms per microbatch, both > 0 (e.g. 20,40)")
    rows, results = overhead(a.pairs, a.only, a.synthetic_ms)
    print()
    print_table(
        [
            "workload",
            "median step off (s)",
            "on (s)",
            "on/off",
            "paired on/off [95% CI]",
            "thread CPU/step off (us)",
            "on (us)",
            "added (us)",
            "step_done CPU (us)",
            "boundary all-reduce (s, least)",
            "CPU stolen by the hypervisor",
        ],
        rows,
    )
    payload = {"pairs": a.pairs, "warmup_pairs": WARMUP, "results": results}
    if a.breakdown:
        brows, bresults = breakdown(a.pairs, a.only, a.synthetic_ms)
        print()
        print_table(
            [
                "workload",
                "on keeps",
                "on/off (wall)",
                "paired on/off [95% CI]",
                "schedule step: added thread CPU (us)",
                "step_done CPU (us)",
                "total added (us)",
            ],
            brows,
        )
        payload["breakdown"] = bresults
    if a.fidelity:
        frows, fresults = fidelity()
        print()
        print_table(
            [
                "schedule",
                "rank",
                "measured - replay: least",
                "median",
                "most",
                "median - mean-time replay (no host, no p2p)",
                "host ms/action",
                "formula",
            ],
            frows,
        )
        payload["fidelity"] = fresults
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
