"""What the DeepSpeed and Megatron-Core integrations cost: step time with each on over off, in one process.

    python benchmarks/framework_overhead.py [--framework deepspeed|megatron|all] [--pairs 40]
        [--synthetic-ms 20,40] [--runs 3]

For each framework two gloo ranks (pp=2, m=8) build the framework's own pipeline from its example
(examples/deepspeed_pipe.py: a PipelineModule run by DeepSpeed's TrainSchedule; examples/megatron_gpt.py:
a GPTModel run by Megatron's 1F1B, with examples/megatron_cpu.py's shims), every stage sleeping F ms
forward and B ms backward per microbatch, and alternate step by step as
benchmarks/integration_overhead.py does: one step watched (the integration attached, a Collector on
the registry, the step boundary), one unwatched (detached: the framework exactly as shipped), pairs in
flipped order, the first pairs dropped as warm-up. Attaching happens between steps, outside the
timing. Goal: on/off <= 1.01 (median step time, a step's time the slower rank's), with the paired
ratio and its distribution-free 95% interval.

Also the training thread's CPU per step (time.thread_time) per mode, split into the framework's step
and the step boundary (step_done), and the CPU added per action: each rank's added thread CPU per step
(the median over pairs of on - off within the pair, with its 95% interval) over the actions that rank
runs per step. Actions are counted, not assumed: one
more watched step after the timed ones, untimed, with a counting observer beside the collector, counts
the spans the integration emitted on each rank: compute (forward, backward, loss) and p2p (send, recv).
Goal: <= 20 us per action. The hooks here run right after the thread wakes from a sleep or a gloo wait,
not warm (benchmarks/hook_cost.py measures both): the figure is an upper bound on the warm one.
Wall-clock ratios need a quiet machine: the table prints the CPU the hypervisor stole and the load
average; the CPU figures do not depend on them.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import tempfile
import time

from common import (
    ROOT,
    cpu_jiffies,
    median_ci,
    megatron_train_step,
    print_table,
    stolen_share,
    two_positive,
    write_json,
)
from integration_overhead import WARMUP, paired_ratio, slower_rank_median

sys.path.insert(0, str(ROOT))

from tests.distutil import load_example, run_ranks  # noqa: E402

FRAMEWORKS = ("deepspeed", "megatron")
P, M = 2, 8
RATIO_GOAL, PER_ACTION_GOAL_US = 1.01, 20.0
RUN_ID = "framework-overhead"


def _deepspeed(rank: int, world: int, ms: str):
    """DeepSpeed's PipelineEngine (TrainSchedule) from the example; (watch, train_step)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed

    from parwatch.integrations import deepspeed as pw

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # adopts the group run_ranks made
    example = load_example("deepspeed_pipe")
    args = example.parse_args(["--pp", str(P), "--microbatches", str(M), "--synthetic-ms", ms])
    engine, _ = example.build(args)
    batches = example.Batches(args)
    watch = pw.watch(engine, run_id=RUN_ID)
    return watch, lambda on: engine.train_batch(batches)  # the optimizer step is an instruction of the schedule


def _megatron(rank: int, world: int, ms: str):
    """Megatron-Core's GPTModel (local spec) run by its 1F1B from the example; (watch, train_step)."""
    import torch
    from megatron.core import parallel_state as ps

    from parwatch.integrations import megatron as pw_megatron

    example = load_example("megatron_gpt")  # puts examples/ on the path: megatron_cpu
    import megatron_cpu

    megatron_cpu.install()
    args = example.parse_args(["--pp", str(P), "--microbatches", str(M), "--synthetic-ms", ms])
    example.FAULTS["now"] = -1  # no injected NaN: the loss checks now == nan_step (0)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=P)
    config = example.megatron_config(args)
    model = example.build_model(args, config)[0]
    example.add_synthetic_compute(model, args.fwd_ms / 1000, args.bwd_ms / 1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = example.microbatches(args, 1)
    watch = pw_megatron.watch([model], config, run_id=RUN_ID, microbatches=M)

    return watch, megatron_train_step(example, watch, model, optimizer, data, args)


BUILDERS = {"deepspeed": _deepspeed, "megatron": _megatron}


def _span_counter():
    from parwatch.contract import Observer

    class SpanCounter(Observer):
        """Counts the spans of one step by kind (one extra step, untimed)."""

        def __init__(self) -> None:
            self.kinds: collections.Counter = collections.Counter()

        def on_span(self, span) -> None:
            self.kinds[str(span.kind.value)] += 1

    return SpanCounter()


def alternate(rank: int, world: int, framework: str, ms: str, pairs: int, log_dir: str) -> dict:
    """Every rank: one pipeline, steps alternately watched and not; then one watched step counted."""
    import torch.distributed as dist

    from parwatch.collector import Collector, attach, detach
    from parwatch.contract import COMPUTE_KINDS, SpanKind, registry

    watch, train_step = BUILDERS[framework](rank, world, ms)
    watch.detach()
    collector = Collector(watch.run_context(), log_path=os.path.join(log_dir, "summaries.jsonl"))
    times: dict = {"on": [], "off": []}
    cpu: dict = {"on": [], "off": []}
    step_cpu: dict = {"on": [], "off": []}  # the framework's step alone, without the boundary
    boundary_cpu: list = []
    step = 0

    def on_step() -> tuple[float, float, float]:
        c0, t0 = time.thread_time(), time.perf_counter()
        train_step(True)
        c1 = time.thread_time()
        nonlocal step
        step = watch.step_done()
        return c0, c1, t0

    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            if mode == "on":
                watch.attach()
                attach(collector)
                watch.start(step)  # opens the attached step's period (an all-reduce: the ranks line up)
                c0, c1, t0 = on_step()
            else:
                dist.barrier()  # the ranks line up as the start boundary makes them do when attached
                c0, t0 = time.thread_time(), time.perf_counter()
                train_step(False)
                c1 = time.thread_time()
                step += 1
            c2, t2 = time.thread_time(), time.perf_counter()
            if pair >= WARMUP:
                times[mode].append(t2 - t0)
                cpu[mode].append(c2 - c0)
                step_cpu[mode].append(c1 - c0)
                if mode == "on":
                    boundary_cpu.append(c2 - c1)
            if mode == "on":
                watch.detach()
                detach(collector)
    counter = _span_counter()
    watch.attach()
    attach(collector)
    registry.register(counter)
    watch.start(step)
    on_step()
    registry.unregister(counter)
    watch.close()
    collector.close()
    compute = {k.value for k in COMPUTE_KINDS}
    p2p = {SpanKind.SEND.value, SpanKind.RECV.value}
    return {
        "times": times,
        "cpu": cpu,
        "step_cpu": step_cpu,
        "boundary_cpu": boundary_cpu,
        "spans": dict(counter.kinds),
        "compute_actions": sum(n for k, n in counter.kinds.items() if k in compute),
        "p2p_actions": sum(n for k, n in counter.kinds.items() if k in p2p),
        "errors": collector.errors,
    }


def measure(framework: str, ms: str, pairs: int) -> dict:
    """One run: a fresh spawn of 2 ranks; the figures of the slower or costlier rank."""
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as log_dir:
        jiffies = cpu_jiffies()
        t0 = time.monotonic()
        per_rank = run_ranks(alternate, P, framework, ms, pairs, log_dir, timeout=600)
        wall = time.monotonic() - t0
        stolen = stolen_share(jiffies, cpu_jiffies())
    load1 = os.getloadavg()
    on, off = slower_rank_median(per_rank, "on"), slower_rank_median(per_rank, "off")
    paired, low, high = paired_ratio(per_rank)
    ranks = []
    for r in per_rank:
        # Added CPU: the median over pairs of on - off within the pair (back to back, so drift in the
        # machine's speed cancels), with its 95% interval; the framework's step alone, without step_done.
        added = median_ci([a - b for a, b in zip(r["cpu"]["on"], r["cpu"]["off"])])
        hooks = median_ci([a - b for a, b in zip(r["step_cpu"]["on"], r["step_cpu"]["off"])])
        actions = r["compute_actions"] + r["p2p_actions"]
        ranks.append(
            {
                "thread_cpu_per_step_off_us": statistics.median(r["cpu"]["off"]) * 1e6,
                "thread_cpu_per_step_on_us": statistics.median(r["cpu"]["on"]) * 1e6,
                "added_cpu_per_step_us": [v * 1e6 for v in added],
                "step_done_cpu_us": statistics.median(r["boundary_cpu"]) * 1e6,
                "added_cpu_in_framework_step_us": [v * 1e6 for v in hooks],
                "spans_per_step": r["spans"],
                "compute_actions": r["compute_actions"],
                "p2p_actions": r["p2p_actions"],
                "spans_in_step": sum(n for k, n in r["spans"].items() if k != "boundary"),
                "added_cpu_per_action_us": [v / actions * 1e6 for v in added],
                "hooks_cpu_per_action_us": [v / actions * 1e6 for v in hooks],
                "thread_cpu_on_s": r["cpu"]["on"],
                "thread_cpu_off_s": r["cpu"]["off"],
                "framework_step_cpu_on_s": r["step_cpu"]["on"],
                "framework_step_cpu_off_s": r["step_cpu"]["off"],
                "collector_errors": r["errors"],
            }
        )
    worst = max(ranks, key=lambda x: x["added_cpu_per_action_us"][0])
    return {
        "framework": framework,
        "synthetic_ms": ms,
        "pp": P,
        "microbatches": M,
        "median_step_off_s": off,
        "median_step_on_s": on,
        "ratio": on / off,
        "paired_ratio_median": paired,
        "paired_ratio_95ci": [low, high],
        "steps_per_mode": len(per_rank[0]["times"]["on"]),
        "per_rank": ranks,
        "worst_rank": ranks.index(worst),
        "added_cpu_per_action_us": worst["added_cpu_per_action_us"],
        "hooks_cpu_per_action_us": worst["hooks_cpu_per_action_us"],
        "ratio_goal_met": on / off <= RATIO_GOAL,
        "per_action_goal_met": worst["added_cpu_per_action_us"][0] <= PER_ACTION_GOAL_US,
        "cpu_stolen_share": stolen,
        "load_average_1min": [load0[0], load1[0]],
        "wall_s": wall,
    }


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _ci(values: list, digits: int) -> str:
    return f"{values[0]:.{digits}f} [{values[1]:.{digits}f}, {values[2]:.{digits}f}]"


def table(results: list[dict]) -> None:
    """One row per run; the CPU columns are the rank with the most added CPU per action."""
    rows = []
    for i, r in enumerate(results, 1):
        worst = r["per_rank"][r["worst_rank"]]
        rows.append(
            [
                i,
                r["median_step_off_s"],
                r["median_step_on_s"],
                r["ratio"],
                _ci([r["paired_ratio_median"], *r["paired_ratio_95ci"]], 4),
                _met(r["ratio_goal_met"]),
                r["worst_rank"],
                f"{worst['thread_cpu_per_step_off_us']:.0f}",
                _ci(worst["added_cpu_per_step_us"], 0),
                f"{worst['step_done_cpu_us']:.0f}",
                f"{worst['compute_actions']}+{worst['p2p_actions']}",
                _ci(r["added_cpu_per_action_us"], 1),
                _ci(r["hooks_cpu_per_action_us"], 1),
                _met(r["per_action_goal_met"]),
                f"{r['cpu_stolen_share']:.0%}",
                "{:.2f} -> {:.2f}".format(*r["load_average_1min"]),
            ]
        )
    print_table(
        [
            "run",
            "median step off (s)",
            "on (s)",
            "on/off",
            "paired on/off [95% CI]",
            f"<= {RATIO_GOAL}",
            "rank",
            "thread CPU/step off (us)",
            "added, paired [95% CI] (us)",
            "step_done (us)",
            "actions/step (compute+p2p)",
            "added/action (us)",
            "without step_done (us)",
            f"<= {PER_ACTION_GOAL_US:.0f} us",
            "CPU stolen",
            "load 1 min (before -> after)",
        ],
        rows,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=(*FRAMEWORKS, "all"), default="all")
    ap.add_argument("--pairs", type=int, default=40, help=f"on/off step pairs (the first {WARMUP} are dropped)")
    ap.add_argument("--synthetic-ms", default="20,40", help="F,B: every stage's forward/backward ms per microbatch")
    ap.add_argument("--runs", type=int, default=1, help="fresh spawns per framework, one after the other")
    ap.add_argument("--out", default="benchmarks/results/framework_overhead.json")
    a = ap.parse_args()
    if a.pairs <= WARMUP:
        ap.error(f"--pairs must be > {WARMUP} (the first {WARMUP} are dropped)")
    if not two_positive(a.synthetic_ms):
        ap.error(f"--synthetic-ms {a.synthetic_ms!r}: give forward,backward ms per microbatch, both > 0 (e.g. 20,40)")
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    frameworks = FRAMEWORKS if a.framework == "all" else (a.framework,)
    results: dict = {f: [] for f in frameworks}
    for run in range(a.runs):
        for framework in frameworks:
            results[framework].append(measure(framework, a.synthetic_ms, a.pairs))
            print(f"run {run + 1}, {framework}: done ({results[framework][-1]['wall_s']:.0f} s)", flush=True)
    for framework, runs in results.items():
        print(f"\n{framework}, p={P} m={M}, {a.synthetic_ms.replace(',', '/')} ms per microbatch")
        table(runs)
    write_json(
        a.out,
        {
            "pairs": a.pairs,
            "warmup_pairs": WARMUP,
            "goals": {"ratio": RATIO_GOAL, "added_cpu_per_action_us": PER_ACTION_GOAL_US},
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
