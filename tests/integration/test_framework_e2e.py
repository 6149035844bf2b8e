"""Megatron-Core and DeepSpeed pipelines under torchrun against a real `parwatch sidecar` (the
packaged default rules), through their examples: a NaN loss is rolled back through the
framework's checkpoint (DeepSpeed's engine.load_checkpoint; the Megatron example's loader) and
the run completes; a hung stage is named (rank, stage, what it is in) within the hang bound."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.e2e_util import (
    ROOT,
    TORCHRUN,
    applied_records,
    decision_records,
    kill_group,
    token_args,
    wait_until,
)
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BOUND_S = 2.0  # --hang-min-seconds (the default is tested in test_hang_e2e.py); these steps are ~50 ms
FRAMEWORKS = {  # name -> (the module it needs, its example, its layout flags)
    "deepspeed": ("deepspeed", "deepspeed_pipe.py", ("--pp", "2", "--microbatches", "2")),
    # DualPipeV: its first rank's commits are send-only, so a hang finding's waiters need the send edge.
    "deepspeed-dualpipev": (
        "deepspeed",
        "deepspeed_pipe.py",
        ("--pp", "2", "--microbatches", "4", "--schedule", "dualpipev"),
    ),
    "megatron": ("megatron.core", "megatron_gpt.py", ("--tp", "1", "--pp", "2", "--microbatches", "2")),
}


def _framework(name: str) -> tuple[str, tuple[str, ...]]:
    module, example, layout = FRAMEWORKS[name]
    pytest.importorskip(module, reason="pip install -e '.[test]' installs megatron-core and deepspeed")
    return str(ROOT / "examples" / example), layout


@pytest.fixture(params=sorted(FRAMEWORKS))
def framework(request):
    return _framework(request.param)


def _start(framework, run_dir: Path, sidecar, *flags: str) -> subprocess.Popen:
    example, layout = framework
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        example,
        *layout,
        "--synthetic-ms",
        "3,6",
        "--parwatch-log",
        str(run_dir / "log"),
        "--parwatch-endpoint",
        sidecar.control_url,
        *token_args(sidecar),
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(run_dir / "out.txt", "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# DualPipeV rolls back through the same engine.load_checkpoint as TrainSchedule (tests/dist/test_deepspeed.py
# rolls it back on 2 ranks): once per framework here.
@pytest.mark.parametrize("name", ["deepspeed", "megatron"])
def test_nan_is_rolled_back_through_the_frameworks_checkpoint(name, tmp_path):
    framework = _framework(name)
    nan_step, steps = 5, 30
    with running_sidecar(tmp_path / "state") as sidecar:
        proc = _start(
            framework,
            tmp_path / "run",
            sidecar,
            "--steps",
            str(steps),
            "--pre-step-check",
            "off",  # the NaN reaches the weights: the sidecar's rollback through the framework's checkpoint
            "--inject",
            f"nan:step={nan_step}",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--losses-out",
            str(tmp_path / "losses.json"),
        )
        try:
            code = proc.wait(200)
        finally:
            kill_group(proc)
        output = (tmp_path / "run" / "out.txt").read_text(errors="replace")
        assert code == 0, output[-4000:]
    [decision] = [d for d in decision_records(tmp_path / "state") if d["rule"] == "nonfinite-loss"]
    assert decision["action"] == "rollback" and decision["step"] == nan_step
    assert decision["checkpoint"] == nan_step - 1  # the newest checkpoint saved before the NaN
    [applied] = [a for a in applied_records(tmp_path / "state") if a["directive_id"] == decision["directive_id"]]
    assert applied["counts"] == {"applied": 2} and applied["loaded_step"] == nan_step - 1
    losses = {int(s): float(v) for s, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    assert sorted(losses) == list(range(1, steps + 1))  # the run completed, on the new timeline
    assert all(v == v for v in losses.values()), losses  # no NaN survives the rollback


# The quick fault campaign (test_fault_campaign.py) hangs a Megatron and a DeepSpeed stage in every default run
# and checks the same (the rank, its stage, blocked running a forward, the other stage waiting): here those two
# are `slow` repeats, and DualPipeV, which the campaign does not run, stays in the default tier.
HUNG_DEFAULT_TIER = {"deepspeed-dualpipev"}


@pytest.fixture(
    scope="module",
    params=[pytest.param(f, marks=() if f in HUNG_DEFAULT_TIER else pytest.mark.slow) for f in sorted(FRAMEWORKS)],
)
def hung_stage(request, tmp_path_factory) -> dict:
    """Stage 1 hung at step 6, the sidecar's hang bound at 2 s: the first finding, whether the run was still
    up then, and when the stage blocked (its log)."""
    base = tmp_path_factory.mktemp(f"hang-{request.param}")
    with running_sidecar(base / "state", "--hang-min-seconds", str(BOUND_S)) as sidecar:
        proc = _start(_framework(request.param), base / "run", sidecar, "--steps", "1000", "--hang-at", "1:6")
        try:
            [record] = wait_until(
                lambda: [d for d in decision_records(base / "state") if d["rule"] in ("hang", "rank-gone")],
                "a hang finding",
                timeout=150,
            )
            alive = proc.poll() is None
            text = (base / "run" / "out.txt").read_text(errors="replace")
        finally:
            kill_group(proc)
    blocked = re.search(r"injected hang at step \d+, blocking at ([0-9.]+)", text)
    assert blocked, text[-3000:]
    return {"record": record, "alive": alive, "blocked_at": float(blocked.group(1))}


def test_a_hung_stage_is_named(hung_stage):
    record = hung_stage["record"]
    assert hung_stage["alive"]  # stuck, not gone
    assert record["rule"] == "hang", record
    culprit = record["evidence"]["culprit"]
    assert (culprit["rank"], culprit["stage"], culprit["kind"], culprit["state"]) == (1, 1, "forward", "running")
    assert record["evidence"]["waiting"] == [0]


@pytest.mark.timing
def test_a_hung_stage_is_named_within_the_bound(hung_stage):
    record = hung_stage["record"]
    elapsed = record["time"] - hung_stage["blocked_at"]
    print(f"\nhung stage named {elapsed:.1f} s after it blocked (bound {record['evidence']['bound_seconds']:g} s)")
    assert elapsed <= record["evidence"]["bound_seconds"] + 1.0, (elapsed, record["evidence"])
