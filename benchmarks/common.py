"""Helpers shared by the benchmark scripts: run the trainer, print a table, write JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def cpu_ticks() -> list[int]:
    """/proc/stat's "cpu" line since boot: user nice system idle iowait irq softirq steal [guest
    guest_nice: already inside user/nice]; [] where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def cpu_jiffies() -> tuple[int, int]:
    """(stolen, total) CPU ticks of this machine since boot; (0, 0) where there is none (not Linux)."""
    fields = cpu_ticks()
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def stolen_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to other guests between two cpu_jiffies():
    a virtual machine's noisy neighbours. Above a few percent, latency figures measure the host,
    not the code (a stolen slice stalls whatever was running for milliseconds)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def watched(args: list[str]) -> bool:
    """Whether trainer ARGS ask for the collector: the trainer's own reading of --parwatch auto|on|off."""
    from parwatch.trainer.config import parse_args

    return parse_args(args).watched


def run_trainer(args: list[str], timeout: float = 600, env: dict | None = None) -> dict:
    """Run `python -m parwatch.trainer ARGS --summary-json TMP` and return the summary."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "summary.json")
        launcher = (
            ["parwatch", "train"] if watched(args) else ["parwatch.trainer"]
        )  # only parwatch's attaches the collector
        cmd = [sys.executable, "-m", *launcher, *args, "--summary-json", path]
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return json.loads(Path(path).read_text())


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.4f}"
    return str(c)


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    print(f"\nwrote {path}")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile (q in 0-100) of `values`; NaN where there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """The median of `values` with a distribution-free 95% interval for it (order statistics
    n/2 -+ 0.98 sqrt(n)): for paired differences, whose spread says what one run can resolve."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, int((n - 1.96 * n**0.5) / 2))
    return statistics.median(ordered), ordered[k], ordered[n - 1 - k]


def two_positive(text: str) -> bool:
    """Whether `text` is "F,B": two positive numbers (a --synthetic-ms value)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        return False
    return len(values) == 2 and all(v > 0 for v in values)


def megatron_train_step(example, watch, model, optimizer, data: list, args):
    """`train_step(on)`: one step of examples/megatron_gpt.py's model (`example`, loaded) over the
    microbatches `data`, watched (the optimizer step in its span) or not, as the overhead benchmarks
    alternate them (the watch attached or detached between steps)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def train_step(on: bool) -> None:
        optimizer.zero_grad()
        get_forward_backward_func()(  # fetched after attach/detach: the watched one or Megatron's own
            forward_step_func=example.forward_step_func,
            data_iterator=iter(data),
            model=model,
            num_microbatches=args.microbatches,
            seq_length=args.seq,
            micro_batch_size=args.microbatch_size,
        )
        if on:
            watch.optimizer_step(optimizer)
        else:
            optimizer.step()

    return train_step
