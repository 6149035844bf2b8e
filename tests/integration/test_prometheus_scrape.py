"""Real tools against a real sidecar: promtool lints /metrics, and Prometheus scrapes and queries it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from tests import one_client
from tests.fixtures import synthetic as syn
from tests.sidecar_process import free_port, running_sidecar, stop

pytestmark = pytest.mark.integration

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.3)]


def needs(binary):
    return pytest.mark.skipif(
        not shutil.which(binary) and not shutil.os.path.exists(binary),
        reason=f"{binary} is not installed (Debian package prometheus)",
    )


def post_step(sp, step: int) -> None:
    """One step of a 2-stage run: both ranks, rank 0 with the fast-path global view; stage 1
    computes half as long as the schedule allows, so its bubble is 0.6 against 0.2 in theory."""
    summaries = [
        syn.summary(
            r,
            step,
            time=time.time(),
            checkpoints=[1] if step > 1 else [],
            compute_scale=0.5 if r == 1 else 1.0,
            global_stages=STAGES if r == 0 else None,
        )
        for r in (0, 1)
    ]
    r = one_client.post(
        f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=sp.headers, timeout=10
    )
    assert r.status_code == 200, r.text


@pytest.fixture
def sidecar(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        for step in (1, 2, 3):
            post_step(sp, step)
        # an action counter too
        one_client.post(f"{sp.control_url}/v1/control", json={"action": "pause"}, headers=sp.headers)
        yield sp


@needs(PROMTOOL)
def test_promtool_finds_nothing_to_lint(sidecar):
    text = one_client.get(f"{sidecar.metrics_url}/metrics").text
    assert "parwatch_step_duration_seconds_bucket" in text and "parwatch_guardrail_actions_total" in text
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and lint.stdout.strip() == "" and lint.stderr.strip() == "", lint.stdout + lint.stderr


@contextlib.contextmanager
def prometheus(tmp_path, target: str):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: parwatch\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")
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
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if one_client.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        log.close()


def query(url: str, promql: str) -> list:
    r = one_client.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


@needs(PROMETHEUS)
def test_prometheus_scrapes_and_answers_queries(sidecar, tmp_path):
    target = sidecar.metrics_url.removeprefix("http://")
    done = threading.Event()

    def keep_posting():  # the run goes on while Prometheus scrapes
        step = 4
        while not done.is_set():
            post_step(sidecar, step)
            step += 1
            done.wait(0.25)

    feeder = threading.Thread(target=keep_posting, daemon=True)
    feeder.start()
    try:
        with prometheus(tmp_path, target) as url:
            deadline = time.monotonic() + 60
            while not (query(url, "parwatch_stage_bubble_ratio") and query(url, "parwatch_train_step")):
                assert time.monotonic() < deadline, "no parwatch series in Prometheus after 60 s"
                time.sleep(0.5)
            time.sleep(2.5)  # a few more scrapes, so rate() has points
            bubble = query(url, "parwatch_stage_bubble_ratio")
            assert {(s["metric"]["rank"], s["metric"]["stage"]) for s in bubble} == {("0", "0"), ("1", "1")}
            assert float(query(url, "parwatch_train_step")[0]["value"][1]) >= 4
            excess = query(
                url,
                "max(parwatch_stage_bubble_ratio - on(stage) group_left "
                "max by (stage) (parwatch_stage_bubble_theoretical_ratio))",
            )
            assert float(excess[0]["value"][1]) == pytest.approx(0.6 - 0.2, abs=1e-9)
            assert query(url, "rate(parwatch_tokens_total[5s])"), "tokens counter has no rate"
            assert query(url, "histogram_quantile(0.5, sum by (le) (rate(parwatch_step_duration_seconds_bucket[5s])))")
            up = query(url, 'up{job="parwatch"}')
            assert up and up[0]["value"][1] == "1"
    finally:
        done.set()
        feeder.join(10)
