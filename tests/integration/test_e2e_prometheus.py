"""A real Prometheus scrapes a real sidecar while a real trainer run (TP2 x PP2, 4 ranks) reports
to it, and answers parwatch_ queries through its HTTP API during the run."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests import one_client
from tests.integration.e2e_util import (
    SMALL_MODEL,
    is_finite_loss,
    running_trainer,
    synthetic,
    token_args,
    wait_until,
)
from tests.sidecar_process import free_port, running_sidecar, stop

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus is not installed (Debian package prometheus)"),
]


@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str):
    """Prometheus on a free loopback port scraping `target` every second; yields its URL."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: parwatch\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready():
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                return one_client.get(f"{url}/-/ready", timeout=2).status_code == 200
            return False

        wait_until(ready, "Prometheus to become ready", timeout=60, interval=0.2)
        yield url
    finally:
        stop(proc)


def query(url: str, promql: str) -> list:
    r = one_client.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


def scrape_view(url: str) -> dict:
    """What Prometheus answers now about the run."""
    step = query(url, "parwatch_train_step")
    return {
        "step": float(step[0]["value"][1]) if step else None,
        "bubble_stages": {s["metric"]["stage"] for s in query(url, "parwatch_stage_bubble_ratio")},
        "collectives": {
            (s["metric"]["group"], s["metric"]["op"])
            for s in query(url, "count by (group, op) (parwatch_collective_duration_seconds_bucket)")
        },
    }


def test_prometheus_scrapes_the_sidecar_during_a_real_run(tmp_path):
    steps = 60
    with (
        running_sidecar(tmp_path / "state") as sp,
        prometheus(tmp_path, sp.metrics_url.removeprefix("http://")) as prom,
        running_trainer(
            sp.control_url,
            tmp_path / "run",
            steps,
            *token_args(sp),
            *SMALL_MODEL,
            "--tp",
            "2",
            "--pp",
            "2",
            *synthetic(5, 10),
            nproc=4,
        ) as run,
    ):
        during = []  # Prometheus' answers while the trainer was still running
        while run.proc.poll() is None:
            view = scrape_view(prom)
            if run.proc.poll() is None:
                during.append(view)
            time.sleep(0.5)
        summary = run.wait()
        # One more scrape after the last step, then the whole history of the step gauge.
        wait_until(lambda: scrape_view(prom)["step"] == steps, "Prometheus to scrape the last step", timeout=30)
        (series,) = query(prom, "parwatch_train_step[10m]")
        history = [float(v) for _, v in series["values"]]
        bubble = query(prom, "parwatch_stage_bubble_ratio")
        buckets = query(prom, 'parwatch_collective_duration_seconds_bucket{le="+Inf"}')

    assert summary["steps_completed"] == steps and all(is_finite_loss(x) for x in summary["losses"])
    seen = [v for v in during if v["step"] is not None]
    moving = sorted({v["step"] for v in seen if v["step"] < steps})
    assert len(moving) >= 2 and [v["step"] for v in seen] == sorted(v["step"] for v in seen), during
    assert any(v["bubble_stages"] == {"0", "1"} for v in seen), during
    assert any({("tp", "all_reduce"), ("pp", "send"), ("pp", "recv")} <= v["collectives"] for v in seen), during

    assert history == sorted(history) and history[-1] == steps and len(set(history)) >= 3, history
    # Every rank's bubble ratio, labelled with its stage (ranks 0, 1: stage 0; 2, 3: stage 1).
    by_rank = {s["metric"]["rank"]: (s["metric"]["stage"], float(s["value"][1])) for s in bubble}
    assert {rank: stage for rank, (stage, _) in by_rank.items()} == {"0": "0", "1": "0", "2": "1", "3": "1"}
    assert all(0.0 < ratio < 1.0 for _, ratio in by_rank.values()), by_rank
    counts = {(s["metric"]["group"], s["metric"]["op"]): float(s["value"][1]) for s in buckets}
    assert counts[("tp", "all_reduce")] > 0 and counts[("pp", "send")] > 0 and counts[("pp", "recv")] > 0, counts
    print(
        f"\nPrometheus during the run: steps seen {[v['step'] for v in seen]} ({len(during)} polls); collective counts {counts}"
    )
