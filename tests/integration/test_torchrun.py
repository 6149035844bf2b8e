"""`python -m parwatch.trainer` under torchrun (env:// rendezvous): the way multi-node runs start it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from parwatch.ports import free_port

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torchrun_ranks_train_together_under_one_run_id(tmp_path):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this Python")
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "parwatch",
            "train",
            "--pp",
            "2",
            "--steps",
            "3",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--seq-len",
            "16",
            "--parwatch",
            "on",
            "--parwatch-log",
            str(tmp_path),
            "--summary-json",
            str(summary),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(summary.read_text())
    assert result["world_size"] == 2 and result["steps_completed"] == 3 and len(result["losses"]) == 3
    rows = [json.loads(line) for line in (tmp_path / "summaries.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in rows} == {0, 1}
    # static rendezvous gives no shared id: rank 0's is broadcast, so the sidecar sees one run
    assert len({r["run_id"] for r in rows}) == 1
