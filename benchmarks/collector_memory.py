"""Collector memory over a long run: 10,000 steps of a real (single-rank) trainer.

    python benchmarks/collector_memory.py [--steps 10000]

A world-1 trainer under zero-length synthetic compute runs the real hook,
boundary and collector paths at a few hundred steps a second, with the
collector writing its JSONL files. The Python heap allocated from parwatch's own
modules (tracemalloc, filtered by file), the whole heap and the process RSS are
sampled every 1000 steps; flat means parwatch's part does not grow with steps.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import print_table, write_json  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--out", default="benchmarks/results/collector_memory.json")
    a = ap.parse_args()
    import torch.distributed as dist

    from parwatch import contract
    from parwatch.collector.attach import attach_from_config
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    samples = []

    class Sampler(contract.Observer):
        def on_boundary(self, info, rows):
            if info.kind == "step" and info.step % 1000 == 0:
                snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/parwatch/*")])
                ours = sum(stat.size for stat in snap.statistics("filename"))
                samples.append([info.step, ours, tracemalloc.get_traced_memory()[0], rss_bytes()])

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as log_dir:
        cfg = TrainConfig(
            steps=a.steps,
            layers=1,
            hidden=8,
            heads=1,
            vocab=8,
            seq_len=4,
            micro_batch_size=1,
            microbatches=1,
            synthetic_compute="fwd_ms=0,bwd_ms=0",
            parwatch="on",
            parwatch_log=log_dir,
            run_id="memory-bench",
        )
        collector = attach_from_config(cfg, 0, 1, 0, "gloo")
        contract.registry.register(Sampler())
        tracemalloc.start()
        Trainer(cfg, 0, 1).run()
        tracemalloc.stop()
        collector.close()
    dist.destroy_process_group()
    base = samples[0]
    rows = [[s, ours / 1024, (ours - base[1]) / 1024, heap / 1024, rss / 2**20] for s, ours, heap, rss in samples]
    print_table(["step", "parwatch heap (KiB)", "growth since first (KiB)", "whole heap (KiB)", "RSS (MiB)"], rows)
    growth = samples[-1][1] - base[1]
    print(
        f"\nparwatch's heap growth from step {base[0]} to {samples[-1][0]}: {growth / 1024:.1f} KiB "
        "(the whole heap also holds the trainer's per-step loss history, one entry a step, by design)"
    )
    keys = ["step", "parwatch_heap_bytes", "heap_bytes", "rss_bytes"]
    write_json(
        a.out,
        {"steps": a.steps, "samples": [dict(zip(keys, s)) for s in samples], "parwatch_heap_growth_bytes": growth},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
