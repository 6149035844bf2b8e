"""The goodput ledger against torch.profiler: an independent view of the same steps on real ranks.

Two gloo ranks run examples/torch_pipelining.py's `train()` (1F1B, P=2, M=4) with real compute:
the example's stage module is replaced by plain layers (ComputeStage: no sleeps, no custom
autograd), so the rank's busy time is aten ops the profiler records. torch.profiler (CPU activities) wraps the whole run on every rank, and a marker
(a zero-length record_function) is placed right after each step boundary returns; each rank's
chrome trace is exported.

The checker (tests/trace_check.py) imports nothing of parwatch: from the trace alone it takes the window between
two step markers and the union of the intervals of every compute op (cpu_op events, the
collectives' and point-to-point ops left out) clipped to it: busy, and idle = window - busy.

The ledger's view of the same window is the difference of the cumulative `time_seconds` of the
summaries at the window's first and last step boundaries. Its busy is productive (forward,
backward and loss compute) plus optimizer (the rank computing the update): both are the rank's
own compute, which the profiler sees as ops. Everything else (the bubble, exposed communication,
data wait, unattributed host time) is the rank not computing: idle. The bar (the issue's): each
rank's busy and idle shares of the window within 2 percentage points.

What the two views do not share: the ledger's compute spans hold the host's Python between the
ops of an action (module calls, the pipelining runtime's bookkeeping, parwatch's hooks), which the
profiler's ops do not. That is a fixed cost per action, so the layers are wide enough (2048) for the
ops to dwarf it; a rank descheduled in that Python also counts busy to the ledger only, so the cost
grows with the host's load (1536 gave +2.1 and +2.7 pp with both cores taken; 1024 came near the bar
on a quiet machine: docs/benchmarks.md). The example's batch generation
is the ledger's data wait (idle) but ops to the profiler, so the test marks it (DATA_MARK) and the
checker leaves its ops out of busy: unmarked, it was 0.7-1.5 of the 2 points on a quiet machine, and
CI on 198d3d9 failed at 2.4.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distutil import load_example, run_ranks
from tests.trace_check import DATA_MARK, MARK, ledger_busy, trace_busy

# serial: a rank descheduled between ops counts busy to the ledger only, so the gap grows with the host's
# load (above). In the parallel phase beside the other workers it reached 3.6 pp against the 2-point bar
# (rank 0, 2026-12-07; CI had passed it there only by luck). Alone it is the comparison the bar is for.
pytestmark = [pytest.mark.dist, pytest.mark.serial, pytest.mark.timeout(120)]

P, STEPS, LAYERS = 2, 14, 2
FIRST, LAST = 4, STEPS  # the window: step FIRST's boundary to step LAST's (the first steps warm up)
ARGV = [
    "--schedule",
    "1f1b",
    "--microbatches",
    "4",
    "--synthetic-ms",
    "0,0",
    "--hidden",
    "2048",
    "--microbatch-size",
    "32",
    "--steps",
    str(STEPS),
]
TOLERANCE = 0.02


class ComputeStage(torch.nn.Module):
    """One virtual stage of plain compute (no sleeps, no custom autograd): LAYERS x (linear, tanh).
    Takes the example's stage arguments and ignores the synthetic times."""

    def __init__(self, hidden: int, fwd_s: float, bwd_s: float, first: bool, seed: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def profiled_rank(rank: int, world_size: int, out_dir: str) -> str:
    """Every rank: the example under torch.profiler, a marker after each step boundary; the trace's path."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from parwatch.integrations.torch_pipelining import PipelineWatch

    step_done = PipelineWatch.step_done

    def marked_step_done(self, *args, **kwargs):
        step = step_done(self, *args, **kwargs)
        with record_function(f"{MARK}{step}"):
            pass
        return step

    PipelineWatch.step_done = marked_step_done
    example = load_example("torch_pipelining")
    batch = example.batch

    def marked_batch(*args, **kwargs):
        with record_function(DATA_MARK):
            return batch(*args, **kwargs)

    example.batch = marked_batch
    example.SyntheticStage = ComputeStage
    args = example.parse_args(ARGV + ["--run-id", "ledger-profiler", "--parwatch-log", out_dir])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        example.train(args)
    path = os.path.join(out_dir, f"trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    torch.distributed.barrier()
    return path


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ledger-profiler"))
    paths = run_ranks(profiled_rank, P, out, timeout=100)
    with open(os.path.join(out, "summaries.jsonl")) as f:
        summaries = [json.loads(line) for line in f if line.strip()]
    return paths, summaries


@pytest.mark.parametrize("rank", range(P))
def test_busy_and_idle_match_the_profiler(profiled, rank):
    paths, summaries = profiled
    prof_window, prof_busy = trace_busy(paths[rank], FIRST, LAST)
    ledger_window, ledger_busy_s, delta = ledger_busy(summaries, rank, FIRST, LAST)
    prof_share, ledger_share = prof_busy / prof_window, ledger_busy_s / ledger_window
    print(
        f"rank {rank}: profiler window {prof_window:.4f} s busy {prof_share:.4f}; "
        f"ledger window {ledger_window:.4f} s busy {ledger_share:.4f}; "
        f"gap {100 * (ledger_share - prof_share):+.2f} pp; ledger "
        + ", ".join(f"{c} {v:.4f}" for c, v in sorted(delta.items()) if v > 0)
    )
    # The two clocks see the same window (the marker follows the boundary by the collector's own work).
    assert ledger_window == pytest.approx(prof_window, rel=0.02, abs=0.005)
    assert abs(ledger_share - prof_share) <= TOLERANCE  # busy
    assert abs((1 - ledger_share) - (1 - prof_share)) <= TOLERANCE  # idle = window - busy
    assert 0.05 < prof_share < 0.95  # both views have busy and idle time to compare (1F1B's bubble)
