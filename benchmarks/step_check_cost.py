"""What the check before the optimizer step costs: step time with it on over off, alternated in one process.

    python benchmarks/step_check_cost.py [--pairs 40] [--stages 20,40 5,10] [--grads 1,4,16]

Two gloo ranks run the reference trainer (PP2, m=8, unwatched: no collector, so the figure is the
check's alone), every stage sleeping F ms forward and B ms backward per microbatch, and alternate step
by step: one step with the check (parwatch.contract.StepCheck: each rank's gradient norm, then one
6-float SUM all-reduce over the world, then the decision), one without (the trainer's
--pre-step-check off: the update goes in unchecked), pairs in flipped order, the first pairs dropped as
warm-up. Goal: on/off <= 1.01 at 20/40 ms stages (median step time, a step's time the slower rank's),
with the paired ratio and its distribution-free 95% interval. Also the check's own wall time and the
training thread's CPU in it per step (the slower rank's median).

A synthetic stage holds one parameter, so there the check's gradient pass is nothing. --grads N,...
measures that pass on its own for N million float32 gradient elements on this CPU, against
torch.optim.AdamW's step over the same parameters (which reads every gradient several times): what a
real model's check adds, per gradient element, beside the optimizer step it guards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, cpu_jiffies, median_ci, print_table, stolen_share, two_positive, write_json
from integration_overhead import WARMUP, paired_ratio, slower_rank_median

sys.path.insert(0, str(ROOT))

from tests.distutil import run_ranks  # noqa: E402

RATIO_GOAL = 1.01
GOAL_STAGES = "20,40"


def alternate(rank: int, world: int, stages: str, pairs: int) -> dict:
    """Every rank: one trainer, steps alternately with the check on and off."""
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    fwd, bwd = stages.split(",")
    cfg = TrainConfig(
        pp=2,
        microbatches=8,
        steps=10**6,
        layers=2,
        synthetic_compute=f"fwd_ms={fwd},bwd_ms={bwd}",
        run_id="step-check-cost",
    )
    trainer = Trainer(cfg, rank, world)
    check = trainer.step_check
    assert check is not None
    spent: dict[str, list[float]] = {"wall": [], "cpu": []}
    run = check.run

    def timed(*args, **kwargs):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent["wall"].append(time.perf_counter() - t0)
            spent["cpu"].append(time.thread_time() - c0)

    check.run = timed  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"on": [], "off": []}
    trainer.begin()
    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            trainer.step_check = check if mode == "on" else None
            t0 = time.perf_counter()
            trainer.run_step()
            if pair >= WARMUP:
                times[mode].append(time.perf_counter() - t0)
    trainer.close()
    kept = slice(WARMUP, None)
    return {"times": times, "check_wall": spent["wall"][kept], "check_cpu": spent["cpu"][kept]}


def step_cost(pairs: int, stages: list[str]) -> tuple[list, list]:
    rows, results = [], []
    for st in stages:
        jiffies = cpu_jiffies()
        per_rank = run_ranks(alternate, 2, st, pairs, timeout=900)
        stolen = stolen_share(jiffies, cpu_jiffies())
        on, off = slower_rank_median(per_rank, "on"), slower_rank_median(per_rank, "off")
        paired, low, high = paired_ratio(per_rank)
        wall = max(statistics.median(r["check_wall"]) for r in per_rank)
        cpu = max(statistics.median(r["check_cpu"]) for r in per_rank)
        name = f"PP2 m=8, {st.replace(',', '/')} ms"
        rows.append(
            [name, off, on, on / off, f"{paired:.4f} [{low:.4f}, {high:.4f}]", wall * 1e3, cpu * 1e6, f"{stolen:.0%}"]
        )
        results.append(
            {
                "workload": name,
                "stages_ms": st,
                "median_step_off_s": off,
                "median_step_on_s": on,
                "ratio": on / off,
                "paired_ratio_median": paired,
                "paired_ratio_95ci": [low, high],
                "check_wall_median_s": wall,
                "check_thread_cpu_median_s": cpu,
                "steps_per_mode": len(per_rank[0]["times"]["on"]),
                "cpu_stolen_share": stolen,
                "goal_met": (on / off <= RATIO_GOAL) if st == GOAL_STAGES else None,
            }
        )
        print(f"{name}: done", flush=True)
    return rows, results


def gradient_pass(millions: list[int], repeats: int = 9) -> tuple[list, list]:
    """The check's reading (a norm over every gradient, one host read) against AdamW's step, same tensors."""
    import torch

    from parwatch.contract import torch_grads

    torch.set_num_threads(1)
    rows, results = [], []
    for n in millions:
        params = [torch.nn.Parameter(torch.randn(n * 250_000)) for _ in range(4)]  # n M elements in 4 tensors
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        optimizer.step()  # its state built outside the timing
        check_s, adam_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch_grads.reading(1.0, torch_grads.grads_of(params))
            check_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            optimizer.step()
            adam_s.append(time.perf_counter() - t0)
        check, adam = median_ci(check_s)[0], median_ci(adam_s)[0]
        rows.append([f"{n} M fp32", check * 1e3, adam * 1e3, check / adam])
        results.append({"elements_millions": n, "check_reading_s": check, "adamw_step_s": adam, "share": check / adam})
    return rows, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=40, help="on/off pairs per stage shape (the first 3 dropped)")
    ap.add_argument("--stages", nargs="+", default=[GOAL_STAGES, "5,10"], help="F,B ms per microbatch and stage")
    ap.add_argument("--grads", default="1,4,16", help="millions of gradient elements for the gradient pass")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_check_cost.json"))
    args = ap.parse_args()
    if args.pairs <= WARMUP or not all(two_positive(s) for s in args.stages):
        ap.error(f"--pairs must exceed {WARMUP}; --stages takes F,B pairs of positive ms, e.g. 20,40")
    rows, steps = step_cost(args.pairs, args.stages)
    print_table(
        [
            "workload",
            "step off s",
            "step on s",
            "on/off",
            "paired on/off [95% CI]",
            "check ms",
            "check CPU us",
            "CPU stolen",
        ],
        rows,
    )
    grad_rows, grads = gradient_pass([int(n) for n in args.grads.split(",") if n])
    print()
    print_table(["gradients", "check's reading ms", "AdamW step ms", "reading / AdamW"], grad_rows)
    write_json(args.out, {"goal_on_off": RATIO_GOAL, "steps": steps, "gradient_pass": grads})
    return 0


if __name__ == "__main__":
    sys.exit(main())
