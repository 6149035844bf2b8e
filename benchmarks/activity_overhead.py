"""Overhead of live activity reporting on the training step: on/off alternating inside one process.

One real trainer rank set (gloo, --nproc 2 via torch.multiprocessing in tests.distutil) runs blocks of
steps with the activity thread running (posting to a real `parwatch sidecar`) and blocks without
it, alternating, so machine load drifts hit both alike. Reports the ratio of median step times
(goal: on/off <= 1.005). The collector stays attached in both (its own cost is measured by
benchmarks/collector_overhead.py), so the registry.current stores happen in both, as they do in
production; what differs is the activity thread sampling and posting once per --interval.

Also the reporter thread's own CPU (its pthread CPU clock) over the "on" blocks' wall time: the most
it can take from the training thread through the GIL, a bound that machine noise does not blur (the
step-time ratio on this shared 2-core machine moved between 0.94 and 1.06 from run to run).

    python benchmarks/activity_overhead.py --blocks 10 --steps 30 --out benchmarks/results/activity_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import write_json  # noqa: E402

WARMUP_STEPS = 20


def _rank(rank: int, world: int, endpoint: str, blocks: int, steps: int, interval_s: float, token: str) -> dict:
    import time

    from parwatch import contract
    from parwatch.collector.activity import ActivityReporter
    from parwatch.collector.attach import attach
    from parwatch.collector.collector import Collector
    from parwatch.collector.context import RunContext
    from parwatch.contract import BoundaryKind
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    cfg = TrainConfig(
        pp=2, microbatches=4, steps=1, layers=4, hidden=64, heads=4, vocab=128, seq_len=32, micro_batch_size=2
    )
    trainer = Trainer(cfg, rank, world)
    ctx = RunContext.for_rank("bench", rank, tp=1, pp=2, dp=1, schedule=cfg.schedule, microbatches=4)
    collector = attach(Collector(ctx))  # no endpoint: its own activity thread stays off
    times = {"on": [], "off": [], "reporter_cpu_s": 0.0, "reporter_posts": 0, "on_wall_s": 0.0}
    trainer.boundary(BoundaryKind.START)
    for _ in range(WARMUP_STEPS):  # allocator growth, the first autograd graphs: in neither mode
        trainer.boundary(BoundaryKind.STEP, trainer.train_step())
    for block in range(blocks):
        mode = ("on", "off", "off", "on")[block % 4]  # ABBA: a drift in the machine's speed hits both alike
        reporter = None
        if mode == "on":
            reporter = ActivityReporter(
                ctx,
                contract.registry,
                endpoint,
                token=token,
                interval_s=interval_s,
                summary_fn=lambda: collector.last_summary,
            ).start()
        for i in range(steps):
            t0 = time.perf_counter()
            loss = trainer.train_step()
            trainer.boundary(BoundaryKind.STEP, loss)
            if i:  # a block's first step follows the reporter's start or stop
                times[mode].append(time.perf_counter() - t0)
        if reporter is not None:
            # The reporter thread's own CPU: what it can take from the training thread (the GIL) at most.
            clock = time.pthread_getcpuclockid(reporter._thread.ident)
            times["reporter_cpu_s"] += time.clock_gettime(clock)
            times["reporter_posts"] += reporter.sent
            times["on_wall_s"] += sum(times["on"][-(steps - 1) :])
            reporter.close()
    collector.close()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=12, help="alternating blocks, on off off on ...")
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--interval", type=float, default=1.0, help="activity report interval (s)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from tests.distutil import run_ranks
    from tests.sidecar_process import running_sidecar

    with tempfile.TemporaryDirectory(prefix="parwatch-activity-") as tmp:
        with running_sidecar(Path(tmp) / "state") as sidecar:
            results = run_ranks(
                _rank, 2, sidecar.control_url, args.blocks, args.steps, args.interval, sidecar.token, timeout=900
            )
    on = [t for r in results for t in r["on"]]
    off = [t for r in results for t in r["off"]]
    cpu, posts, wall = (sum(r[k] for r in results) for k in ("reporter_cpu_s", "reporter_posts", "on_wall_s"))
    out = {
        "step_seconds_median_on": statistics.median(on),
        "step_seconds_median_off": statistics.median(off),
        "ratio_on_off": statistics.median(on) / statistics.median(off),
        "steps_on": len(on),
        "steps_off": len(off),
        "reporter_posts": posts,
        "reporter_cpu_ms_per_post": cpu / max(posts, 1) * 1e3,
        "reporter_cpu_share_of_on_time": cpu / wall if wall else float("nan"),
        "goal": "ratio <= 1.005",
    }
    for k, v in out.items():
        print(f"{k:<26} {v}")
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
