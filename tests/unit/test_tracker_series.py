"""The leader's tracker points, step by step, against /metrics: a real sidecar (in process, its real
/metrics and control API) takes summaries whose figures change every step, writes a point every 2 steps to
TensorBoard through the real worker thread, and TensorBoard's own reader finds every series /metrics
implies at each written step, and every decision."""

from __future__ import annotations

import json
import math
import threading

import pytest
from fastapi.testclient import TestClient

from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.sidecar.trackers.exports import Exports
from parwatch.sidecar.trackers.series import MAX_SERIES, SeriesBuilder, histogram_quantile
from parwatch.sidecar.trackers.spec import ExportError, ExportSpec, parse_export
from parwatch.sidecar.trackers.tb_sink import TensorBoardSink
from parwatch.sidecar.trackers.worker import TrackerWorker
from parwatch.vocabulary import Tracker
from tests.fixtures import synthetic as syn
from tests.trackers_readback import expected, read_tensorboard, same

pytest.importorskip("tensorboardX")
pytest.importorskip("tensorboard")

EVERY = 2
STEPS = 9


def stages(step: int) -> list[dict]:
    views = [syn.stage_view(0, 0.5 + 0.01 * step, 0.38), syn.stage_view(1, 0.5 + 0.01 * step, 0.30 - 0.005 * step)]
    for view in views:  # the bubble's causes, as rank 0's shipper adds them
        bubble = view["bubble_ratio"]
        view |= {"bubble_schedule_ratio": 0.2, "bubble_imbalance_ratio": 0.01 * step}
        view["bubble_wait_ratio"] = max(0.0, bubble - 0.2 - 0.01 * step)
    return views


def post_step(control, step: int) -> None:
    summaries = [
        syn.summary(
            r,
            step,
            pp=2,
            step_seconds=0.4 + 0.03 * step,
            compute_scale=1.0 - 0.02 * r * step,
            loss=3.0 - 0.1 * step,
            global_stages=stages(step) if r == 0 else None,
        )
        for r in range(2)
    ]
    summaries[0]["model_flops_utilization_ratio"] = 0.3 + 0.01 * step
    summaries[0]["collectives"].append(syn.collective("all_reduce", "dp", step, 0.001 * step, 1 << 20, 2))
    r = control.post("/v1/ingest", json={"version": 1, "summaries": summaries})
    assert r.status_code == 200, r.text


def test_every_written_step_holds_what_metrics_said_then(tmp_path):
    tb = tmp_path / "tb"
    config = SidecarConfig(
        state_dir=tmp_path / "state", exports=(ExportSpec(Tracker.TENSORBOARD, str(tb)),), export_every_steps=EVERY
    )
    sidecar = build_sidecar(config)
    control = TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})
    metrics = TestClient(create_metrics_app(sidecar))
    scrapes: dict[int, str] = {}
    for step in range(1, STEPS + 1):
        post_step(control, step)
        if step == 3:
            assert control.post("/v1/control", json={"action": "pause", "reason": "a look"}).status_code == 200
        if step == 5:
            assert control.post("/v1/control", json={"action": "resume"}).status_code == 200
        if step % EVERY == 0:
            scrapes[step] = metrics.get("/metrics").text
    sidecar.tick()  # the decisions after the last point
    sidecar.close()  # the run's last step (9, not a multiple of 2) and the tracker run finished
    scrapes[STEPS] = metrics.get("/metrics").text

    scalars, texts = read_tensorboard(tb / "synthetic")
    written = sorted({step for series in scalars.values() for step in series})
    assert written == [2, 4, 6, 8, 9]
    before = ""
    for step in written:
        want = expected(scrapes[step], before)
        got = {name: series[step] for name, series in scalars.items() if step in series}
        assert set(got) == set(want), (step, set(got) ^ set(want))
        for name, value in want.items():
            assert same(got[name], value, float32=True), (step, name, got[name], value)
        before = scrapes[step]
    for name in (
        "loss",
        "step_seconds",
        "mfu",
        "bubble/stage_0/measured",
        "bubble/stage_1/wait",
        "collective_p99/all_reduce/dp",
    ):
        assert name in scalars, name
    assert (
        len(scalars["bubble/stage_1/measured"]) == len(written)
        and len({round(v, 6) for v in scalars["loss"].values()}) > 1
    )

    decisions = [d for d in control.get("/v1/decisions", params={"limit": 100}).json() if d["type"] == "decision"]
    assert [d["action"] for d in decisions] == ["pause", "resume"]
    assert sorted(json.loads(t)["id"] for _, t in texts["decisions"]) == [d["id"] for d in decisions]
    for step, text in texts["decisions"]:
        record = json.loads(text)
        assert record == next(d for d in decisions if d["id"] == record["id"])
        assert step == record["step"]
    families = {f.name: f for f in sidecar.registry.collect()}
    counts = {
        name: {s.labels["tracker"]: s.value for s in families[f"parwatch_tracker_points_{name}"].samples}
        for name in ("written", "dropped")
    }
    assert counts == {"written": {Tracker.TENSORBOARD: 5}, "dropped": {Tracker.TENSORBOARD: 0}}  # a point per step


def test_a_slow_tracker_drops_the_oldest_points_and_counts_them(tmp_path):
    release = threading.Event()

    class Slow(TensorBoardSink):  # the real writer, held up before each write
        def write(self, point):
            release.wait(30)
            super().write(point)

    from parwatch.sidecar.trackers.series import Point

    worker = TrackerWorker(ExportSpec(Tracker.TENSORBOARD, str(tmp_path)), lambda: Slow(str(tmp_path)), max_queued=3)
    for step in range(1, 11):
        worker.put(Point("slow-run", step, {"loss": float(step)}))
    release.set()
    assert worker.close(30)
    scalars, _ = read_tensorboard(tmp_path / "slow-run")
    kept = sorted(scalars["loss"])
    assert worker.written == len(kept) and worker.dropped == 10 - len(kept) > 0
    assert kept[-3:] == [8, 9, 10]  # the newest got through


def test_series_beyond_the_cap_are_left_out_least_important_first():
    now = {
        "parwatch_loss": {(): 1.0},
        "parwatch_straggler_ratio": {(("cause", f"c{i}"),): 0.1 for i in range(60)},
    }
    builder = SeriesBuilder()
    got = builder.scalars(now)
    assert len(got) == MAX_SERIES and "loss" in got and len(builder.left_out) == 11


def test_histogram_quantile_interpolates_as_prometheus_does():
    # 100 observations: 50 <= 0.01, 40 in (0.01, 0.1], 10 in (0.1, 1]: rank 99 lies 9/10 into the last bucket.
    edges = [(0.01, 50.0), (0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.99, edges) == pytest.approx(0.1 + 0.9 * 0.9)
    assert histogram_quantile(0.5, edges) == pytest.approx(0.01)
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 3.0)]) == 0.1  # in +Inf: the highest finite edge
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_export_values_name_the_fix(monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert parse_export("tensorboard:/tmp/tb") == ExportSpec(Tracker.TENSORBOARD, "/tmp/tb")
    assert parse_export("wandb").experiment == "parwatch" and parse_export("wandb:proj").experiment == "proj"
    assert parse_export("mlflow:http://mlflow:5000#exp") == ExportSpec(Tracker.MLFLOW, "http://mlflow:5000", "exp")
    for value, words in (
        ("comet:x", "unknown tracker"),
        ("tensorboard", "log directory"),
        ("mlflow", "tracking URI"),
        ("mlflow:file:./mlruns", "MLFLOW_ALLOW_FILE_STORE"),
        ("mlflow:./mlruns", "MLFLOW_ALLOW_FILE_STORE"),
    ):
        with pytest.raises(ExportError, match=words):
            parse_export(value)


def test_a_node_sidecar_writes_no_point(tmp_path):
    """Only the sidecar that judges the run (the leader: it hears rank 0) writes to the trackers."""
    config = SidecarConfig(
        state_dir=tmp_path / "state",
        exports=(ExportSpec(Tracker.TENSORBOARD, str(tmp_path / "tb")),),
        export_every_steps=1,
        leader_url="http://leader:9401",
    )
    sidecar = build_sidecar(config)
    control = TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})
    for step in (1, 2):  # rank 0 reports to the leader: this node has rank 1 only
        body = {"version": 1, "summaries": [syn.summary(1, step, pp=2)]}
        assert control.post("/v1/ingest", json=body).status_code == 200
    exports = sidecar.exports
    assert isinstance(exports, Exports)
    sidecar.close()
    assert exports.workers[0].written == 0 and not (tmp_path / "tb").exists()


def test_a_late_summary_after_the_runs_end_opens_no_second_tracker_run(tmp_path, monkeypatch):
    """CI: a rank's last summaries came after the run's end (past FINAL_SUMMARIES_SECONDS, under load), and the
    point they made opened a second W&B run (offline: a second run directory)."""
    from parwatch.sidecar.trackers import exports as exports_module

    opened: list[str] = []

    class Counting:
        def open(self, run_id):
            opened.append(run_id)

        def write(self, point):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(exports_module, "make_sink", lambda spec, state_dir: Counting())
    config = SidecarConfig(
        state_dir=tmp_path / "state", exports=(ExportSpec(Tracker.TENSORBOARD, str(tmp_path)),), export_every_steps=1
    )
    sidecar = build_sidecar(config)
    control = TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})
    for step in (1, 2):
        post_step(control, step)
    sidecar.store.ended = True  # every rank done (activity_api.note_if_ended)
    sidecar.tick()  # the final point
    post_step(control, 3)  # late
    sidecar.tick()
    sidecar.close()
    assert opened == ["synthetic"]
