"""A host starved of CPU slows a healthy run; it does not hang it (issue 40: CI on 4a597bf named a hang when
a healthy run's steps took 8-13x their median for ~11 s beside the suite's start-ups).

The run (four gloo ranks, TP2 x PP2, the trainer's own model: its steps need the CPU; its launcher and its
sidecar) shares one core with SPINNERS busy loops for STARVE_S: a step then takes several times the hang
bound (7.1-7.6 s against a median of 0.17 s, three runs; before this change the leader named a hang). Its
node counts how long each rank waited for a CPU (parwatch/sidecar/cpu_wait.py) and the leader judges the
stall without that wait. That a rank hung on such a host is still named, by 4x the bound at the latest, is
tests/unit/test_cpu_wait.py's; how late, the fault campaign's (docs/benchmarks.md)."""

from __future__ import annotations

import time

import pytest

from parwatch.sidecar.hang import HangSettings
from tests.integration.e2e_util import decision_records, running_trainer, token_args, wait_until
from tests.sidecar_process import running_sidecar
from tests.starving import on_one_core, spinning

# Serial: it starves a core on purpose. In the lane, beside the serial phase on the other core, two CIs in a row
# (b40bb8e, 7e4c289) had a serial figure off its bar (a timing re-run; the ledger against the profiler, 2.48 pp
# against 2): the two cores of this VM are not independent enough for busy loops beside a figure.
pytestmark = [pytest.mark.serial, pytest.mark.integration, pytest.mark.timeout(300)]

SPINNERS = 25
STARVE_S = 5.0
BOUND_S = HangSettings.min_seconds


def test_a_healthy_run_on_a_starved_core_is_slow_not_hung(tmp_path):
    with on_one_core(), running_sidecar(tmp_path / "state") as sidecar:
        with running_trainer(
            sidecar.control_url, tmp_path / "run", 40, "--tp", "2", "--pp", "2", *token_args(sidecar), nproc=4
        ) as run:
            wait_until(lambda: len(run.summaries(0)) >= 10, "10 steps before the starvation", timeout=120)
            with spinning(SPINNERS):
                time.sleep(STARVE_S)
            run.wait()  # exit 0
            time.sleep(1.5)  # the leader's judgements of the run's last seconds
            findings = [d for d in decision_records(tmp_path / "state") if d["rule"] in ("hang", "rank-gone")]
    slowest = max(s["step_seconds"] for s in run.summaries())
    assert slowest > BOUND_S, f"no step longer than the bound ({slowest:.2f} s): the core was not starved"
    assert findings == [], [(d["rule"], d["reason"]) for d in findings]
