"""One bubble per stage, end to end: the guardrail, the recording rule, the dashboard panel, the
alert expression and the report compute the same stage bubble and excess from one run.

The run: TP2 x PP2 (ranks 0, 1 on stage 0; ranks 2, 3 on stage 1), 1F1B with m=4, where the
ranks of a stage spend unequal time outside the pipeline (a long optimizer on rank 1, a slow DP
sync on rank 3), so a stage's time-weighted bubble differs from the mean of its ranks' ratios,
the formula the dashboard and the alerts drew before. Its summaries are built by the collector's
own code (stats.breakdown, the boundary vector summed as the all-reduce sums it, the global view,
as the StepSummary record the collector builds) with the same figures every step, and posted to a real sidecar through a
proxy in front of its /metrics: each scrape first posts the next step, so a real Prometheus only
ever sees whole steps and its rates cover the same steps on every rank.

Read five ways, per stage:
- the guardrail: the sidecar's rules (the default bubble-excess, and max/min rules on the bubble
  and its excess so that each stage's value is reported) through /v1/status;
- the recording rules (dashboards/recording_rules.yaml) evaluated by Prometheus;
- the dashboard's bubble panels' queries (dashboards/parwatch.json's);
- the alert expressions rendered from the same rules (the bubble-excess one is the shipped
  dashboards/alerts.yaml's), as Prometheus' active alerts carry their values;
- the report's bubble table from the run's summaries.jsonl (and the trainer's run totals).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from msgspec import to_builtins

from parwatch import bubble
from parwatch import dashboards as dash
from parwatch import recording as rec
from parwatch.collector import global_view as gv
from parwatch.collector.context import RunContext
from parwatch.collector.run_totals import RunTotals
from parwatch.collector.stats import breakdown
from parwatch.guardrails.alerts import alert_name, render_alert_rules_yaml
from parwatch.guardrails.rules import load_rules
from parwatch.report.loader import load_run
from parwatch.report.stats import bubble_table
from parwatch.wire.codec import encode
from parwatch.wire.steps import StepSummary
from tests import one_client
from tests.integration.e2e_util import wait_until
from tests.sidecar_process import free_port, running_sidecar, stop

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus is not installed (Debian package prometheus)"),
]

TP, PP, M, SCHEDULE = 2, 2, 4, "1f1b"
STEP_S = 0.5
RANKS = {0: (0.25, 0.02), 1: (0.25, 0.15), 2: (0.40, 0.02), 3: (0.25, 0.10)}
"""rank -> (compute, other) seconds of every step; the step period is shared (the boundary collective)."""
STEPS = 200
"""More than the test waits for: the proxy posts one per scrape."""
TOLERANCE = 1e-9
EXTRA_RULES = [  # max and min over two stages: each stage's value reported by the guardrail
    {"name": "bubble-most", "metric": "bubble_ratio", "reduce": "max", "above": 0.0, "action": "alert"},
    {"name": "bubble-least", "metric": "bubble_ratio", "reduce": "min", "below": 1.0, "action": "alert"},
    {"name": "excess-least", "metric": "bubble_excess_ratio", "reduce": "min", "below": 1.0, "action": "alert"},
]


def contexts() -> dict[int, RunContext]:
    return {
        r: RunContext.for_rank(
            "bubble-run",
            r,
            tp=TP,
            pp=PP,
            dp=1,
            schedule=SCHEDULE,
            microbatches=M,
            tokens_per_step=4096,
            hostname="test-host",
        )
        for r in RANKS
    }


def step_summaries(step: int) -> list[StepSummary]:
    """Every rank's summary of `step`, rank 0's with the global view of step-1, as the collectors send them."""
    ctxs = contexts()
    results = {r: breakdown(STEP_S, compute, other) for r, (compute, other) in RANKS.items()}
    view = None
    if step > 1:
        summed = [0.0] * gv.slots_for(PP)
        for r, ctx in ctxs.items():  # the SUM all-reduce of every rank's slots at boundary `step`
            slots = [0.0] * gv.slots_for(PP)
            gv.fill_slots(slots, rank=r, stage=ctx.stage, previous=results[r], previous_step=step - 1)
            summed = [x + y for x, y in zip(summed, slots)]
        view = gv.build_global_view(summed, PP, loss=2.0)
    return [
        StepSummary(
            v=1,
            run_id=ctx.run_id,
            rank=r,
            stage=ctx.stage,
            tp_rank=ctx.tp_rank,
            dp_rank=ctx.dp_rank,
            tp=TP,
            pp=PP,
            dp=1,
            microbatches=M,
            schedule=ctx.schedule,
            step=step,
            time=time.time(),
            step_seconds=results[r].step_seconds,
            compute_seconds=results[r].compute_seconds,
            other_seconds=results[r].other_seconds,
            idle_seconds=results[r].idle_seconds,
            bubble_ratio=results[r].bubble_ratio,
            bubble_theoretical_ratio=ctx.bubble_theoretical_ratio,
            wire_loss=2.0 if ctx.stage == PP - 1 else None,
            tokens=ctx.tokens_per_step,
            global_=view if r == 0 else None,
        )
        for r, ctx in ctxs.items()
    ]


def expected() -> tuple[dict, dict]:
    """(time-weighted bubble, mean of the ranks' ratios) per stage, from the figures themselves."""
    weighted, mean = {}, {}
    for stage in range(PP):
        mine = [breakdown(STEP_S, *RANKS[r]) for r, ctx in contexts().items() if ctx.stage == stage]
        weighted[stage] = sum(b.idle_seconds for b in mine) / sum(b.idle_seconds + b.compute_seconds for b in mine)
        mean[stage] = sum(b.bubble_ratio for b in mine) / len(mine)
    return weighted, mean


class FeedingProxy:
    """/metrics of the sidecar, each scrape first posting the next step (whole steps only)."""

    def __init__(self, sp, run_log: Path):
        self.sp, self.run_log, self.step = sp, run_log, 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body, ctype = proxy.scrape(self.headers.get("Accept", ""))
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def post_next(self) -> None:
        with self.lock:
            if self.step >= STEPS:
                return
            self.step += 1
            summaries = step_summaries(self.step)
            r = one_client.post(
                f"{self.sp.control_url}/v1/ingest",
                json={"version": 1, "summaries": to_builtins(summaries)},
                headers=self.sp.headers,
                timeout=30,
            )
            assert r.status_code == 200, r.text
            with open(self.run_log, "a") as f:  # what the collectors' shippers write
                f.writelines(encode(s).decode() + "\n" for s in summaries)

    def scrape(self, accept: str) -> tuple[bytes, str]:
        self.post_next()
        r = one_client.get(f"{self.sp.metrics_url}/metrics", headers={"Accept": accept} if accept else {}, timeout=30)
        return r.content, r.headers.get("content-type", "text/plain; version=0.0.4")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(timeout=10)


@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str, rule_files: list[Path]):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(p) for p in rule_files],
                "scrape_configs": [{"job_name": "parwatch", "static_configs": [{"targets": [target]}]}],
            }
        )
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
    try:
        yield f"http://127.0.0.1:{port}", proc, log_path
    finally:
        stop(proc)


def api(url: str, path: str, **params):
    with contextlib.suppress(httpx.HTTPError):
        r = one_client.get(f"{url}/api/v1/{path}", params=params, timeout=10)
        if r.status_code == 200:
            return r.json()["data"]
    return None


def per_stage(data) -> dict[int, float]:
    """An instant query's answer by stage."""
    return {int(s["metric"]["stage"]): float(s["value"][1]) for s in (data or {}).get("result", ())}


def panel_query(title: str) -> str:
    (panel,) = [p for p in dash.build_dashboard()["panels"] if p["title"] == title]
    return panel["targets"][0]["expr"].replace("$job", "parwatch")


def test_the_five_consumers_of_the_stage_bubble_agree(tmp_path):
    weighted, mean = expected()
    theory = bubble.theoretical(SCHEDULE, PP, M)
    excess = {s: bubble.excess(b, theory) for s, b in weighted.items()}
    # The run tells the two formulas apart, and stage 0's excess is above the default guardrail's 0.10.
    assert all(abs(weighted[s] - mean[s]) > 0.005 for s in weighted), (weighted, mean)
    assert excess[0] > 0.10 > excess[1]

    rules_path = tmp_path / "rules.yaml"
    doc = yaml.safe_load(dash.DEFAULT_RULES.read_text())
    doc["rules"] = [r for r in doc["rules"] if r["name"] == "bubble-excess"] + EXTRA_RULES
    rules_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rules = load_rules(rules_path)
    alerts_path = tmp_path / "alerts.yaml"
    alerts_path.write_text(render_alert_rules_yaml(rules))
    shipped = {
        a["alert"]: a["expr"]
        for a in yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())["groups"][0]["rules"]
    }
    rendered = {a["alert"]: a["expr"] for a in yaml.safe_load(alerts_path.read_text())["groups"][0]["rules"]}
    assert rendered["ParwatchBubbleExcess"] == shipped["ParwatchBubbleExcess"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    with (
        running_sidecar(tmp_path / "state", "--rules", str(rules_path)) as sp,
        FeedingProxy(sp, run_dir / "summaries.jsonl") as proxy,
        prometheus(tmp_path, proxy.target, [ROOT / "dashboards" / "recording_rules.yaml", alerts_path]) as (
            prom,
            proc,
            log,
        ),
    ):
        alert_names = {alert_name(r) for r in rules.rules}

        def everything():
            assert proc.poll() is None, log.read_text()
            recorded = per_stage(api(prom, "query", query=rec.stage_bubble()))
            active = api(prom, "alerts")
            alerts = {a["labels"]["alertname"]: float(a["value"]) for a in (active or {}).get("alerts", ())}
            # A few steps in the rate window, every stage recorded, every bubble alert raised.
            return (proxy.step >= 5 and len(recorded) == PP and alert_names <= set(alerts)) and alerts

        alerts = wait_until(
            everything, "Prometheus to record the stage bubble and raise every bubble alert", timeout=120, interval=0.5
        )
        recorded = per_stage(api(prom, "query", query=rec.stage_bubble()))
        recorded_excess = per_stage(api(prom, "query", query=rec.stage_bubble_excess()))
        panel = per_stage(api(prom, "query", query=panel_query("Bubble ratio per stage vs theoretical")))
        panel_excess = per_stage(api(prom, "query", query=panel_query("Bubble excess (measured - theoretical)")))
        status = one_client.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=10).json()["rules"]
        posted = proxy.step

    def guardrail(rule: str) -> tuple[int, float]:
        state = status[rule]
        return int(state["series"].removeprefix("stage=")), float(state["last_value"])

    seen = {"guardrail": {}, "guardrail excess": {}}
    for rule in ("bubble-most", "bubble-least"):
        stage, value = guardrail(rule)
        seen["guardrail"][stage] = value
    for rule in ("bubble-excess", "excess-least"):
        stage, value = guardrail(rule)
        seen["guardrail excess"][stage] = value
    seen["recording rule"], seen["recording rule excess"] = recorded, recorded_excess
    seen["dashboard panel"], seen["dashboard panel excess"] = panel, panel_excess
    # Max and min over the stages: stage 0 idles more, stage 1 less.
    seen["alert"] = {0: alerts["ParwatchBubbleMost"], 1: alerts["ParwatchBubbleLeast"]}
    seen["alert excess"] = {0: alerts["ParwatchBubbleExcess"], 1: alerts["ParwatchExcessLeast"]}
    report = bubble_table(load_run(run_dir).summaries, list(range(PP)))
    seen["report"] = {row.stage: row.measured for row in report}
    seen["report excess"] = {row.stage: row.excess for row in report}
    totals = RunTotals(PP, M, 1)
    for step in range(2, posted + 1):
        totals.add_global(step_summaries(step)[0].global_)
    seen["run totals"] = {s["stage"]: s["bubble_ratio"] for s in totals.as_dict()["stages"]}

    print(f"\n{posted} steps; time-weighted {weighted}, mean of ratios {mean}; theory {theory}")
    for name, values in seen.items():
        print(f"  {name:24s} {values}")
    for name, values in seen.items():
        want = excess if name.endswith("excess") else weighted
        assert values == pytest.approx(want, abs=TOLERANCE), (name, values, want)
