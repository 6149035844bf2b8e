"""benchmarks/gpu_check.py's integration sections in their CPU fallback (gloo, host clock), so the
script a GPU session runs in its few minutes does not rot between sessions without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_section(name: str) -> dict:
    """gpu_check.<name>(False, pairs=4) in a fresh process (each section owns its process group); its result."""
    program = f"import json, gpu_check\nprint('RESULT ' + json.dumps(gpu_check.{name}(False, pairs=4)))\n"
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=os.path.join(ROOT, "benchmarks"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["clock"] == "PerfCounterClock"  # CudaClock on a GPU
    assert result["summaries"] == 4 and result["unresolved_spans"] == 0 and result["errors"] == 0
    assert result["steps_per_mode"] == 2  # 4 pairs, the first 2 dropped
    assert 0 < result["compute_seconds"] <= result["step_seconds"]
    return result


def test_the_pipelining_section_runs_watched_and_unwatched_steps_and_resolves_every_span():
    result = run_section("pipelining_check")
    assert 0 <= result["bubble_ratio"] < 1
    assert result["ratio"] > 0 and result["median_off_s"] > 0


def test_the_deepspeed_section_runs_watched_and_unwatched_steps():
    result = run_section("deepspeed_check")
    assert result["bubble_ratio"] < 0.5  # one stage: no pipeline bubble, only the step's own overhead


def test_the_megatron_section_runs_watched_and_unwatched_steps():
    run_section("megatron_check")
