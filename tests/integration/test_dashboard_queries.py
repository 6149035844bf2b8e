"""Every dashboard query runs on a real Prometheus against every catalogue metric.

A small HTTP server in the test exposes a realistic run (tp=2, pp=2: four ranks, two stages,
every op/group, every default guardrail) built from parwatch.catalog.METRICS with
prometheus_client on a private registry; counters grow with wall time so rates are real.
/usr/bin/prometheus scrapes it every second and evaluates dashboards/recording_rules.yaml (the
panels read only recorded series); once it holds three evaluations, each panel's PromQL
(Grafana's $__ variables replaced by concrete values) must succeed and return data.
The same queries against VictoriaMetrics, fed by agent-mode Prometheus and vmalert:
tests/integration/test_victoriametrics.py.
"""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from parwatch import dashboards as dash
from parwatch.catalog import METRICS, STEP_BUCKETS
from parwatch.ports import free_port
from parwatch.vocabulary import SelfPart, TimeCategory, Tracker
from parwatch.wire.steps import COLLECTIVE_BUCKETS

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SUBSTITUTIONS = {"$__range_s": "300", "$__range": "5m", "$price_per_gpu_hour": "2.5", "$job": "parwatch"}
RECORDING_RULES = Path(__file__).resolve().parents[2] / "dashboards" / "recording_rules.yaml"
START_TIMEOUT_S = 60

RANKS = {0: 0, 1: 0, 2: 1, 3: 1}  # rank -> stage (tp=2, pp=2)
OPS = [
    ("all_reduce", "tp"),
    ("all_gather", "tp"),
    ("reduce_scatter", "tp"),
    ("send", "pp"),
    ("recv", "pp"),
    ("all_reduce", "dp"),
    ("broadcast", "dp"),
]
RULES = [r["name"] for r in yaml.safe_load(dash.DEFAULT_RULES.read_text())["rules"]]
LABEL_VALUES = {
    "run_id": ["demo-1"],
    "schedule": ["1f1b"],
    "tp": ["2"],
    "pp": ["2"],
    "dp": ["1"],
    "order": ["tp-pp-dp"],
    "part": [p.value for p in SelfPart],
    "tracker": [t.value for t in Tracker],
    "microbatches": ["4"],
    "version": ["0.1.0"],
    "rule": RULES,
    "action": ["alert", "rollback"],
    "op": ["send"],
    "group": ["pp"],
    "reason": ["remote"],
    "cause": ["slow-link"],
    "post": ["digest"],
}


def _histogram(edges, count, mean):
    """Cumulative buckets for `count` observations spread around `mean`."""
    buckets = []
    for edge in edges:
        below = count if edge >= 2 * mean else (count / 2 if edge >= mean else 0.0)
        buckets.append((repr(float(edge)), below))
    return buckets + [("+Inf", count)], count * mean


class RealisticRun(Collector):
    """Every catalogue metric, with values a 2x2 TP+PP run would report t seconds in."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.t0 = clock, clock()

    def label_sets(self, metric):
        if "category" in metric.labels:  # the goodput ledger: every category of every rank
            return [
                {"rank": str(r), "stage": str(s), "category": c.value} for r, s in RANKS.items() for c in TimeCategory
            ]
        if set(metric.labels) >= {"rank"}:
            rest = {k: LABEL_VALUES[k][0] for k in metric.labels if k not in ("rank", "stage", "gpu")}
            return [{"rank": str(r), "stage": str(s), "gpu": str(r), **rest} for r, s in RANKS.items()]
        if metric.labels == ("stage",):
            return [{"stage": str(s)} for s in sorted(set(RANKS.values()))]
        if metric.labels == ("op", "group"):
            return [{"op": op, "group": g} for op, g in OPS]
        if metric.labels == ("rule",):
            return [{"rule": r} for r in RULES]
        if metric.labels == ("rule", "action"):
            return [{"rule": "stage-skew", "action": "alert"}, {"rule": "nonfinite-loss", "action": "rollback"}]
        return [{k: LABEL_VALUES[k][0] for k in metric.labels}]

    def collect(self):
        t = 10.0 + self.clock() - self.t0  # seconds into the run
        for m in METRICS:
            sets = self.label_sets(m)
            names = list(m.labels)
            if m.kind == "info":
                fam = InfoMetricFamily(m.name[: -len("_info")], "run metadata", labels=[])
                fam.add_metric([], sets[0])
            elif m.kind == "counter":
                fam = CounterMetricFamily(m.name, m.name, labels=names)
                for i, ls in enumerate(sets):
                    fam.add_metric(
                        [ls[k] for k in names],
                        t * (1000.0 if "bytes" in m.name or "tokens" in m.name else 0.1) * (i + 1),
                    )
            elif m.kind == "histogram":
                fam = HistogramMetricFamily(m.name, m.name, labels=names)
                edges, mean = (STEP_BUCKETS, 0.5) if "step" in m.name else (COLLECTIVE_BUCKETS, 0.002)
                for ls in sets:
                    buckets, total = _histogram(edges, count=round(t * 20), mean=mean)
                    fam.add_metric([ls[k] for k in names], buckets, total)
            else:
                fam = GaugeMetricFamily(m.name, m.name, labels=names)
                for i, ls in enumerate(sets):
                    fam.add_metric([ls[k] for k in names], self.gauge_value(m.name, t, i))
            yield fam

    @staticmethod
    def gauge_value(name, t, i):
        if name in ("parwatch_train_step", "parwatch_checkpoint_last_good_step"):
            return float(int(t * 2) // (10 if "checkpoint" in name else 1))
        if name in ("parwatch_guardrail_state", "parwatch_rank_state"):
            return float(i % 3)  # ok/pending/firing; running/hung/gone
        if name == "parwatch_rank_up":
            return 0.0 if i == 2 else 1.0  # the rank that is hung has stopped reporting
        if name.endswith("_ratio"):
            return {"parwatch_pipeline_skew_ratio": 1.1, "parwatch_stage_bubble_theoretical_ratio": 0.2}.get(
                name, 0.2 + 0.01 * i
            )
        return {
            "parwatch_loss": 2.3,
            "parwatch_run_paused": 0.0,
            "parwatch_hang_detected": 1.0,
            "parwatch_nvml_up": 1.0,
            "parwatch_rank_up": 1.0,
            "parwatch_gpu_power_watts": 420.0,
            "parwatch_gpu_temperature_celsius": 61.0,
            "parwatch_gpu_sm_clock_hertz": 1.98e9,
        }.get(name, 4.0e10 + i)


def api(base, path, **params):
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:  # Prometheus answers 400/422 with a JSON error body
        return json.loads(err.read())


def wait_for_scrapes(base, n, proc):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prometheus exited early"
        try:
            # Recorded rates need two scrapes, then n evaluations of the recording rules.
            res = api(base, "query", query="count_over_time(job:parwatch_tokens:rate1m[1m])")
            if (
                res["status"] == "success"
                and res["data"]["result"]
                and float(res["data"]["result"][0]["value"][1]) >= n
            ):
                return
        except (OSError, ValueError):
            pass  # not listening yet, or "503 Service Unavailable" in plain text while it starts
        time.sleep(0.5)
    # A scrape that failed (the exporter raised) says why in the target's lastError.
    targets = api(base, "targets").get("data", {}).get("activeTargets", [])
    errors = [t.get("lastError") for t in targets if t.get("lastError")]
    raise AssertionError(f"prometheus did not hold {n} scrapes within {START_TIMEOUT_S}s; scrape errors: {errors}")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus not installed (apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("prom")
    registry = CollectorRegistry()
    registry.register(RealisticRun())
    target_port = free_port()
    server, thread = start_http_server(target_port, addr="127.0.0.1", registry=registry)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RECORDING_RULES)],
        "scrape_configs": [{"job_name": "parwatch", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_scrapes(base, 3, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        server.shutdown()
        thread.join(timeout=5)


def concrete(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


QUERIES = [(p["title"], t["refId"], t["expr"]) for p in dash.build_dashboard()["panels"] for t in p["targets"]]


def test_exposition_carries_every_catalogue_metric(prometheus):
    names = set(api(prometheus, "label/__name__/values")["data"])
    for m in METRICS:
        assert set(m.series()) <= names, f"{m.name} was not scraped"


@pytest.mark.parametrize("title,ref,expr", QUERIES, ids=[f"{t}:{r}" for t, r, _ in QUERIES])
def test_panel_query_runs_and_returns_data(prometheus, title, ref, expr):
    promql = concrete(expr)
    instant = api(prometheus, "query", query=promql)
    assert instant["status"] == "success", f"{title}: {instant.get('error')}"
    assert instant["data"]["result"], f"{title} ({ref}) returned no data: {promql}"
    now = time.time()
    ranged = api(prometheus, "query_range", query=promql, start=now - 30, end=now, step=1)
    assert ranged["status"] == "success", f"{title}: {ranged.get('error')}"
    assert ranged["data"]["result"], f"{title} ({ref}) range query returned no data"


def test_run_variable_lists_the_scrape_job(prometheus):
    """The dashboard's job variable (label_values of a recorded series) finds the run."""
    values = api(prometheus, "label/job/values", **{"match[]": "job:parwatch_train_step:max"})
    assert values["status"] == "success" and values["data"] == [SUBSTITUTIONS["$job"]]
