"""A real run written to all three trackers at once: `parwatch train` (2 ranks, PP2) against a real
`parwatch sidecar --export tensorboard:DIR --export mlflow:file:DIR --export wandb` (no W&B key: offline).
An operator pauses and resumes the run on the way. After the run, each tracker's own reader (TensorBoard's
EventAccumulator, MLflow's client on its file store, `wandb leet inspect` over the offline run file) finds
every series /metrics implies at the last step, equal to it, and every decision, as /v1/decisions has it."""

from __future__ import annotations

import json
import os

import pytest

from tests import one_client
from tests.distutil import installed
from tests.integration.e2e_util import SMALL_MODEL, Control, running_trainer, token_args, wait_until
from tests.sidecar_process import running_sidecar, stop
from tests.trackers_readback import (
    expected,
    read_mlflow,
    read_tensorboard,
    read_wandb,
    same,
    wandb_run_dir,
)

TRACKERS = ("tensorboardX", "tensorboard", "mlflow", "wandb")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not all(map(installed, TRACKERS)), reason=f"needs {', '.join(TRACKERS)}: scripts/setup.sh test"),
]

STEPS = 12
RUN_ID = "tracker-e2e"


def _points(metrics_url: str) -> dict[str, float]:
    text = one_client.get(f"{metrics_url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("parwatch_tracker_points_written_total{"):
            out[line.split('tracker="')[1].split('"')[0]] = float(line.split()[-1])
    return out


@pytest.mark.timeout(300)
def test_one_run_reaches_tensorboard_mlflow_and_wandb_as_metrics_shows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, for the sidecar and the reader
    tb, mlruns, home = tmp_path / "tb", tmp_path / "mlruns", tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"MLFLOW_ALLOW_FILE_STORE": "true", "HOME": str(home)}  # no W&B key, no ~/.netrc: offline
    state = tmp_path / "state"
    exports = ("--export", f"tensorboard:{tb}", "--export", f"mlflow:file:{mlruns}", "--export", "wandb")
    with running_sidecar(state, *exports, "--export-every", str(STEPS), env=env) as sidecar:
        control = Control(sidecar.control_url, sidecar.token)
        args = (
            *token_args(sidecar),
            "--run-id",
            RUN_ID,
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--parwatch-peak-flops",
            "1e12",
            *SMALL_MODEL,
        )
        with running_trainer(sidecar.control_url, tmp_path / "run", STEPS, *args) as run:
            wait_until(lambda: (control.status().get("last_step") or 0) >= 2, "step 2", 150)  # launch included
            for action in ("pause", "resume"):
                r = one_client.post(f"{control.url}/v1/control", json={"action": action}, headers=control.headers)
                assert r.status_code == 200, r.text
            run.wait()
        # The run ended (every rank done): its last step written and each tracker run finished.
        wait_until(
            lambda: all(n >= 2 for n in _points(sidecar.metrics_url).values()),
            f"the final points ({_points(sidecar.metrics_url)}; {control.status()})",
            60,
        )
        final = one_client.get(f"{sidecar.metrics_url}/metrics", timeout=10).text
        decisions = [
            d
            for d in one_client.get(
                f"{control.url}/v1/decisions", params={"limit": 100}, headers=control.headers
            ).json()
            if d["type"] == "decision"
        ]
        assert stop(sidecar.proc) == 0, sidecar.log()
        exports_told = [line for line in sidecar.log().splitlines() if "export" in line or "tracker" in line]
    assert {"pause", "resume"} <= {d["action"] for d in decisions}  # and whatever a rule decided (a loaded machine)
    want = expected(final)  # one point of series, at the last step: its window is the whole run
    for name in ("loss", "step_seconds", "mfu", "goodput/ratio", "bubble/stage_0/measured", "bubble/stage_1/schedule"):
        assert name in want, (name, sorted(want))

    mlflow_scalars, mlflow_texts, status = read_mlflow(f"file:{mlruns}", RUN_ID)
    assert status == "FINISHED"
    readers = {
        "tensorboard": (*read_tensorboard(tb / RUN_ID), True),
        "mlflow": (mlflow_scalars, mlflow_texts, False),
        "wandb": (*read_wandb(wandb_run_dir(state)), False),
    }
    for tracker, (scalars, texts, float32) in readers.items():
        assert set(scalars) == set(want), (tracker, set(scalars) ^ set(want))
        for name, value in want.items():
            assert list(scalars[name]) == [STEPS], (tracker, name, scalars[name])
            assert same(scalars[name][STEPS], value, float32), (tracker, name, scalars[name][STEPS], value)
        got = [json.loads(text) for _, text in texts.get("decisions", [])]
        dropped = [line for line in final.splitlines() if line.startswith("parwatch_tracker_points_dropped_total")]
        # Under a full -n 3 run on 5b69d57, MLflow once had none: what the sidecar told is kept for the next.
        assert got == decisions, (tracker, got, decisions, dropped, exports_told)
