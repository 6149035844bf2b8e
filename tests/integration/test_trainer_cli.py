"""`python -m parwatch.trainer` as a user runs it: bad settings fail in one line, a tiny run learns.

Each case is a real subprocess with a 60 s timeout. A bad setting must exit non-zero
with exactly one stderr line, starting with "error:", that names the setting and says
how to fix it (no traceback, no argparse usage block, no line per rank).
"""

import json
import math
import subprocess
import sys

import pytest

from tests.distutil import ROOT

pytestmark = [pytest.mark.beside_serial, pytest.mark.integration, pytest.mark.timeout(120)]

TINY = ["--layers", "2", "--hidden", "32", "--seq-len", "16"]


def _trainer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "parwatch.trainer", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


BAD = {
    # name: (arguments, what the message must name, the fix it must offer)
    "world-size": (["--nproc", "2", "--tp", "2", "--pp", "2"], "tp*pp*dp", "--nproc 4"),
    "heads-vs-tp": (["--nproc", "3", "--tp", "3"], "--heads=4", "choose tp in [1, 2, 4]"),
    "layers-vs-stages": (["--nproc", "4", "--pp", "4", "--layers", "2"], "--layers=2", "raise --layers to 4"),
    "no-microbatches": (["--microbatches", "0"], "--microbatches=0", "at least 1"),
    "unknown-fault": (["--inject", "meltdown:rank=1"], "--inject 'meltdown:rank=1'", "crash:rank=2,step=7"),
    "fault-missing-key": (["--inject", "straggler:stage=1"], "missing ms", "straggler:stage=1,ms=30"),
    "synthetic-half": (["--synthetic-compute", "fwd_ms=5"], "--synthetic-compute 'fwd_ms=5'", "fwd_ms=10,bwd_ms=20"),
    "synthetic-key": (["--synthetic-compute", "fwd=1,bwd_ms=2"], "--synthetic-compute", "fwd_ms=N,bwd_ms=N"),
    "synthetic-number": (["--synthetic-compute", "fwd_ms=x,bwd_ms=2"], "fwd_ms='x'", "not a number"),
    # The trainer knows nothing of the collector: parwatch's launcher attaches it.
    "watched-alone": (["--parwatch-log", "runs/x"], "--parwatch on", "parwatch train"),
    # Checked only inside each rank today (see the report): one line per rank, after spawning.
    "partition-method": (
        ["--nproc", "2", "--pp", "2", "--partition", "even"],
        "--partition='even'",
        "'uniform' or 'parameters'",
    ),
}


IN_A_PROCESS = {"world-size", "partition-method"}
"""Cases run as the real command; the others call its main() here (the same code, without a 2 s torch import)."""


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_setting_fails_with_one_line_naming_it(case, tmp_path, capsys):
    args, setting, fix = BAD[case]
    summary = tmp_path / "summary.json"
    argv = [*args, *TINY, "--steps", "1", "--summary-json", str(summary)]
    if case in IN_A_PROCESS:
        proc = _trainer(*argv)
        returncode, stderr = proc.returncode, proc.stderr
    else:
        from parwatch.trainer.launch import main

        returncode, stderr = main(argv), capsys.readouterr().err
    lines = stderr.splitlines()
    assert returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert setting in lines[0] and fix in lines[0], lines[0]
    assert not summary.exists()


def test_tiny_run_writes_a_summary_with_finite_losses(tmp_path):
    path = tmp_path / "summary.json"
    proc = _trainer("--steps", "3", "--summary-json", str(path), *TINY)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(path.read_text())
    assert summary["steps_completed"] == 3
    assert len(summary["losses"]) == 3
    assert all(isinstance(x, float) and math.isfinite(x) for x in summary["losses"])
    assert summary["config"]["steps"] == 3 and summary["world_size"] == 1


def test_loss_falls_over_forty_steps_on_one_process(tmp_path):
    path = tmp_path / "summary.json"
    proc = _trainer("--steps", "40", "--summary-json", str(path))  # default model and lr
    assert proc.returncode == 0, proc.stderr
    losses = json.loads(path.read_text())["losses"]
    assert len(losses) == 40
    first, last5 = losses[0], sum(losses[-5:]) / 5
    assert abs(first - math.log(64)) < 0.5  # starts near chance over the 64-token vocabulary
    assert last5 < 0.5 * first, f"loss went from {first:.3f} to a mean of {last5:.3f} over the last 5 steps"


def test_a_run_its_step_check_pauses_with_no_sidecar_exits_naming_it_not_waiting_forever(tmp_path):
    """Three bad batches (NaN every time each is computed) skip three steps, and the third skip pauses the run
    (StepPolicy.pause_after_skips). Unwatched, nothing could ever resume it: before, every rank held at
    that pause until killed (a default 200-step run did, at step 87, on its own loss spikes)."""
    path = tmp_path / "summary.json"
    faults = [arg for step in (4, 5, 6) for arg in ("--inject", f"bad-batch:step={step}")]
    proc = _trainer("--nproc", "2", "--pp", "2", "--steps", "20", "--summary-json", str(path), *TINY, *faults)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "paused at step 6" in proc.stderr and "nothing watching this run can resume it" in proc.stderr
    assert "--pre-step-check off" in proc.stderr and not path.exists()


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_left_for_another(tmp_path, monkeypatch, capsys):
    """CI on f219b8e (the demo's NaN test): between free_port() and rank 0's bind another test's sidecar took
    the port; rank 0 exited "while starting" and the other ranks asked that HTTP server for the rendezvous.
    The launcher starts the ranks again on another port: nothing of the run had started."""
    import socket

    from parwatch.ports import free_port
    from parwatch.trainer import launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = [port]
        monkeypatch.setattr(launch, "free_port", lambda: first.pop() if first else free_port())
        path = tmp_path / "summary.json"
        code = launch.main(["--nproc", "2", "--pp", "2", "--steps", "2", "--summary-json", str(path), *TINY])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"the rendezvous port {port} was taken; starting the ranks again on another" in err
    assert json.loads(path.read_text())["steps_completed"] == 2
