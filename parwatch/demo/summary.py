"""The demo's closing summary: bubble per stage against theory, collectives, decisions, cost."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from parwatch import ledger_view
from parwatch.bubble import closed_form, excess
from parwatch.report.loader import load_run
from parwatch.report.stats import bubble_table, collective_totals, cost_estimate, self_cost_shares
from parwatch.vocabulary import RecordType


def build_summary(run_dir: Path, pp: int, microbatches: int, chunks: int, price: float) -> dict:
    run = load_run(run_dir)
    stages = sorted({s["stage"] for s in run.summaries})
    bubbles = bubble_table(run.summaries, stages)
    theory = closed_form(pp, microbatches, chunks)
    collectives = []
    for c in collective_totals(run.summaries):
        collectives.append(
            {
                "op": c.op,
                "group": c.group,
                "count": int(c.count),
                "p50_seconds": c.quantile(0.5) if c.has_buckets else None,
                "p99_seconds": c.quantile(0.99) if c.has_buckets else None,
                "mean_seconds": c.mean(),
                "busbw_bytes_per_second": c.busbw(),
            }
        )
    cost = cost_estimate(run.summaries, pp, microbatches, chunks, price)
    ledgers = [json.loads(p.read_text()) for p in sorted(run_dir.glob("ledger-rank*.json"))]
    trainer_summary = {}
    if (run_dir / "summary.json").exists():
        trainer_summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "stages": [
            {"stage": b.stage, "bubble_ratio": b.measured, "bubble_theoretical_ratio": theory, "steps": b.steps}
            for b in bubbles
        ],
        "collectives": collectives,
        "decisions": [d for d in run.decisions],
        "cost": {**asdict(cost), "idle_cost": cost.idle_cost, "recoverable_cost": cost.recoverable_cost},
        "steps_completed": trainer_summary.get("steps_completed"),
        "world_size": trainer_summary.get("world_size"),
        "losses": trainer_summary.get("losses", []),
        "time": ledger_view.totals(ledger_view.as_counters(x["time_seconds"]) for x in ledgers),
        "self_cost": self_cost_shares(run.summaries),
    }


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def print_summary(console, summary: dict) -> None:
    from rich.table import Table

    t = Table(title="Pipeline bubble per stage (mean over steps after the first)")
    for col in ("stage", "measured", "theory (p-1)/(m+p-1)", "excess"):
        t.add_column(col, justify="right")
    for s in summary["stages"]:
        m, th = s["bubble_ratio"], s["bubble_theoretical_ratio"]
        t.add_row(
            str(s["stage"]),
            "-" if m is None else f"{m:.3f}",
            f"{th:.3f}",
            "-" if m is None else f"{excess(m, th):+.3f}",
        )
    console.print(t)
    ranks, cores = summary.get("world_size"), os.cpu_count() or 1
    if ranks and cores < ranks:
        console.print(
            f"note: {ranks} ranks share {cores} CPU cores here, so ranks wait for the CPU as well as for "
            "their neighbours; that shows as excess bubble, truthfully.",
            highlight=False,
        )
    t = Table(title="Collectives (all ranks, all steps)")
    for col in ("op", "group", "count", "p50 ms", "p99 ms", "mean ms", "busbw MB/s"):
        t.add_column(col, justify="right")
    for c in summary["collectives"]:
        bw = c["busbw_bytes_per_second"]
        t.add_row(
            c["op"],
            c["group"],
            str(c["count"]),
            _ms(c["p50_seconds"]),
            _ms(c["p99_seconds"]),
            _ms(c["mean_seconds"]),
            "-" if not bw else f"{bw / 1e6:.1f}",
        )
    console.print(t)
    console.print(
        "send spans run from posting the isend to its completion, so they include the receiver's "
        "readiness; recv is the p2p latency to read.",
        highlight=False,
    )
    decisions = [d for d in summary["decisions"] if d.get("type", "decision") == RecordType.DECISION]
    if decisions:
        t = Table(title="Guardrail decisions")
        for col in ("step", "rule", "action", "source", "enforced", "checkpoint", "reason"):
            t.add_column(col)
        for d in decisions:
            t.add_row(
                str(d.get("step")),
                str(d.get("rule")),
                str(d.get("action")),
                str(d.get("source")),
                str(d.get("enforced")),
                str(d.get("checkpoint")),
                str(d.get("reason", ""))[:60],
            )
        console.print(t)
    else:
        console.print("Guardrail decisions: none (every rule stayed ok)")
    console.print(
        "Where the time went (all ranks, process start to exit): " + ledger_view.line(summary.get("time")),
        highlight=False,
    )
    own = summary.get("self_cost")
    if own:
        parts = ", ".join(f"{part} {share:.2%}" for part, share in own.items() if part != "training_thread")
        console.print(
            f"parwatch's own cost: {own['training_thread']:.2%} of the step on the training thread ({parts})",
            highlight=False,
        )
    c = summary["cost"]
    console.print(
        f"Idle accelerator time: {c['idle_gpu_hours'] * 3600:.1f} GPU-seconds "
        f"({c['idle_gpu_hours']:.5f} GPU-hours, ${c['idle_cost']:.4f} at ${c['price_per_gpu_hour']:.2f}/GPU-hour); "
        f"doubling the microbatches would cut the schedule's bubble from {c['bubble_now']:.3f} to "
        f"{c['bubble_doubled']:.3f} of a step, recovering {c['recoverable_gpu_hours'] * 3600:.1f} GPU-seconds.",
        highlight=False,
    )
