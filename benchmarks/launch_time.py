"""What a short `parwatch train --nproc 2` run costs around its steps: launch to the first step's
summary, the last summary to the launcher's exit, the whole wall time, and the CPU seconds of every
process of the run (the launcher, its fork server, the ranks), over N runs.

    python benchmarks/launch_time.py --runs 5 [--nproc 4]

The run: PP2 1F1B (TP = nproc / 2), 2 layers, hidden 32, 3 steps, the collector writing its JSONL files
(no sidecar). For scale, the same table gives `python -c "import torch"` (the floor of every rank's start).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, cpu_jiffies, print_table, stolen_share, write_json  # noqa: E402

RUN = ["--pp", "2", "--steps", "3", "--layers", "2", "--hidden", "32", "--heads", "2"]


def _tree_cpu_s() -> float:
    """CPU seconds of every descendant reaped so far: this process is their subreaper (main), so a rank
    whose parent (the fork server) went first is reaped here, and counted, too."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def one_run(log_dir: Path, nproc: int) -> dict:
    cpu = _tree_cpu_s()
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "parwatch",
            "train",
            "--nproc",
            str(nproc),
            "--tp",
            str(nproc // 2),
            *RUN,
            "--parwatch-log",
            str(log_dir),
        ],  # fmt: skip
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    ended = time.time()
    times = [json.loads(line)["time"] for path in log_dir.rglob("summaries.jsonl") for line in path.open()]
    return {
        "wall_s": ended - started,
        "to_first_step_s": min(times) - started,
        "after_last_step_s": ended - max(times),
        "cpu_s": _tree_cpu_s() - cpu,
    }


def torch_import_s() -> float:
    started = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (even): PP2 x TP nproc/2")
    parser.add_argument("--json", default="benchmarks/results/launch_time.json")
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the ranks' CPU is counted (_tree_cpu_s)
    before = cpu_jiffies()
    runs, imports = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run{i}", args.nproc))
            imports.append(torch_import_s())
    stolen = stolen_share(before, cpu_jiffies())
    rows = [
        [i + 1, r["wall_s"], r["to_first_step_s"], r["after_last_step_s"], r["cpu_s"], t]
        for i, (r, t) in enumerate(zip(runs, imports))
    ]
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    rows.append(["median", *medians.values(), statistics.median(imports)])
    print_table(
        ["run", "wall s", "launch -> first step s", "last step -> exit s", "CPU s (all processes)", "import torch s"],
        rows,
    )
    print(f"stolen CPU: {stolen:.1%}")
    write_json(
        args.json,
        {
            "command": ["--nproc", str(args.nproc), *RUN],
            "runs": runs,
            "torch_import_s": imports,
            "medians": medians,
            "stolen": stolen,
        },
    )


if __name__ == "__main__":
    main()
