"""/metrics: every catalogue family with its labels, histograms and counters built from the
summaries, liveness with an injected clock, OpenMetrics, and label values that need escaping."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from parwatch.catalog import STEP_BUCKETS
from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.wire.codec import parse as parse_record
from parwatch.wire.steps import COLLECTIVE_BUCKETS, IngestBody
from tests.fixtures import synthetic as syn

STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.3)]
GRACE = 10.0

# DESIGN.md's catalogue: family name (as the text format names it) -> label names.
CATALOGUE = {
    "parwatch_run_info": {"run_id", "schedule", "tp", "pp", "dp", "order", "microbatches", "version"},
    "parwatch_train_step": set(),
    "parwatch_loss": set(),
    "parwatch_tokens_total": set(),
    "parwatch_model_flops_utilization_ratio": {"rank"},
    "parwatch_torch_memory_max_allocated_bytes": {"rank", "stage"},
    "parwatch_step_duration_seconds": {"stage"},
    "parwatch_stage_compute_seconds_total": {"rank", "stage"},
    "parwatch_stage_idle_seconds_total": {"rank", "stage"},
    "parwatch_stage_bubble_ratio": {"rank", "stage"},
    "parwatch_stage_bubble_theoretical_ratio": {"stage"},
    "parwatch_pipeline_skew_ratio": set(),
    "parwatch_collective_duration_seconds": {"op", "group"},
    "parwatch_collective_bytes_total": {"op", "group"},
    "parwatch_collective_busbw_bytes_per_second": {"op", "group"},
    "parwatch_gpu_utilization_ratio": {"rank", "gpu"},
    "parwatch_gpu_memory_used_bytes": {"rank", "gpu"},
    "parwatch_gpu_power_watts": {"rank", "gpu"},
    "parwatch_gpu_sm_clock_hertz": {"rank", "gpu"},
    "parwatch_gpu_temperature_celsius": {"rank", "gpu"},
    "parwatch_nvml_up": {"rank"},
    "parwatch_rank_up": {"rank"},
    "parwatch_guardrail_state": {"rule"},
    "parwatch_guardrail_actions_total": {"rule", "action"},
    "parwatch_run_paused": set(),
    "parwatch_checkpoint_last_good_step": set(),
    "parwatch_collector_overhead_ratio": {"rank"},
    "parwatch_collector_dropped_summaries_total": {"rank"},
    "parwatch_sidecar_rules_reload_failures_total": set(),
}


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def env(tmp_path):
    clock = Clock()
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / "state", rank_grace_seconds=GRACE), clock=clock)
    auth = {"Authorization": f"Bearer {sidecar.config.token}"}
    return (
        sidecar,
        TestClient(create_control_app(sidecar), headers=auth),
        TestClient(create_metrics_app(sidecar)),
        clock,
    )


def post(control, *summaries):
    r = control.post("/v1/ingest", json={"version": 1, "summaries": list(summaries)})
    assert r.status_code == 200, r.text


def run_steps(control, steps, tp=2, pp=2, **kw):
    for step in steps:
        summaries = [
            syn.summary(
                r,
                step,
                tp=tp,
                pp=pp,
                time=float(step),
                checkpoints=[1] if step > 1 else [],
                global_stages=STAGES if r == 0 else None,
                **kw,
            )
            for r in range(tp * pp)
        ]
        summaries[0]["model_flops_utilization_ratio"] = 0.41
        post(control, *summaries)


def scrape(metrics, accept=None) -> dict:
    r = metrics.get("/metrics", headers={"accept": accept} if accept else {})
    assert r.status_code == 200
    return r


def families(metrics) -> dict:
    text = scrape(metrics).text
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + ("_total" if fam.type == "counter" else "") + ("_info" if fam.type == "info" else "")
        out[name] = fam
    return out


def samples(fam, suffix=""):
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == fam.name + suffix}


def test_every_catalogue_metric_is_exported_with_its_labels(env):
    _, control, metrics, _ = env
    run_steps(control, [1, 2, 3])
    control.post("/v1/control", json={"action": "pause"})  # so guardrail_actions_total has a sample
    fams = families(metrics)
    for name, labels in CATALOGUE.items():
        assert name in fams, f"{name} missing"
        assert fams[name].samples, f"{name} has no samples"
        for s in fams[name].samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            assert ("le" in s.labels) == s.name.endswith("_bucket")
    # no step, run id or microbatch as a label anywhere except run_info
    for name, fam in fams.items():
        for s in fam.samples:
            assert not {"step", "microbatch"} & set(s.labels)
            assert name == "parwatch_run_info" or "run_id" not in s.labels


def test_values_follow_the_summaries(env):
    _, control, metrics, _ = env
    run_steps(control, [1, 2, 3])
    fams = families(metrics)
    one = lambda name: next(iter(samples(fams[name], "_total" if name.endswith("_total") else "").values()))  # noqa: E731
    assert fams["parwatch_train_step"].samples[0].value == 3
    assert one("parwatch_tokens_total") == 3 * 4096  # once per step, not once per rank
    assert fams["parwatch_checkpoint_last_good_step"].samples[0].value == 1
    info = fams["parwatch_run_info"].samples[0].labels
    assert info["tp"] == "2" and info["pp"] == "2" and info["schedule"] == "1f1b" and info["run_id"] == "synthetic"
    assert info["order"] == "tp-pp-dp"  # the summaries carry none: the default
    theory = samples(fams["parwatch_stage_bubble_theoretical_ratio"])
    assert theory == {(("stage", "0"),): pytest.approx(0.2), (("stage", "1"),): pytest.approx(0.2)}
    compute = samples(fams["parwatch_stage_compute_seconds_total"], "_total")
    one_step = syn.summary(0, 1, tp=2, pp=2)["compute_seconds"]
    assert compute[(("rank", "0"), ("stage", "0"))] == pytest.approx(3 * one_step)
    # step histogram, once per stage: 0.5 s lands in le=0.5 and above
    hist = fams["parwatch_step_duration_seconds"]
    assert {s.labels["stage"] for s in hist.samples} == {"0", "1"}
    assert sum(1 for s in hist.samples if s.name.endswith("_count")) == 2
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket") and s.labels["stage"] == "0"}
    assert len(buckets) == len(STEP_BUCKETS) + 1
    assert buckets["0.25"] == 0 and buckets["0.5"] == 3 and buckets["+Inf"] == 3
    # collective histogram sums over the 4 ranks: 8 all-reduces of 2 ms per rank and step
    coll = fams["parwatch_collective_duration_seconds"]
    ar = {
        s.labels["le"]: s.value for s in coll.samples if s.name.endswith("_bucket") and s.labels["op"] == "all_reduce"
    }
    assert len(ar) == len(COLLECTIVE_BUCKETS) + 1
    assert ar["0.001"] == 0 and ar["0.0025"] == 3 * 4 * 8 and ar["+Inf"] == 96
    count = [s.value for s in coll.samples if s.name.endswith("_count") and s.labels["op"] == "all_reduce"]
    assert count == [96]
    busbw = samples(fams["parwatch_collective_busbw_bytes_per_second"])
    assert busbw[(("group", "tp"), ("op", "all_reduce"))] == pytest.approx((1 << 20) / 0.002)  # 2(n-1)/n = 1 at n=2
    # The views of steps 1 and 2 are the process's warm-up: its pace is not judged on them.
    assert samples(fams["parwatch_guardrail_state"])[(("rule", "bubble-excess"),)] == 0
    assert samples(fams["parwatch_loss"]) == {(): 2.0}
    run_steps(control, [4])
    state = samples(families(metrics)["parwatch_guardrail_state"])
    assert state[(("rule", "bubble-excess"),)] == 1  # pending: 0.18 excess


def test_retried_summaries_are_not_counted_twice(env):
    _, control, metrics, _ = env
    run_steps(control, [1])
    run_steps(control, [1])
    fams = families(metrics)
    assert samples(fams["parwatch_tokens_total"], "_total") == {(): 4096}
    counts = [s.value for s in fams["parwatch_step_duration_seconds"].samples if s.name.endswith("_count")]
    assert counts == [1, 1]  # one per stage


def test_silent_rank_goes_down_then_its_series_vanish(env):
    _, control, metrics, clock = env
    run_steps(control, [1])
    clock.t += 5
    post(control, *[syn.summary(r, 2, tp=2, pp=2) for r in (0, 1, 2)])  # rank 3 stops reporting
    clock.t += GRACE - 4  # rank 3 silent for GRACE + 1 s, the others for 6 s
    fams = families(metrics)
    assert samples(fams["parwatch_rank_up"]) == {
        (("rank", "0"),): 1,
        (("rank", "1"),): 1,
        (("rank", "2"),): 1,
        (("rank", "3"),): 0,
    }
    assert (("rank", "3"), ("stage", "1")) in samples(fams["parwatch_stage_bubble_ratio"])  # still there
    clock.t += GRACE  # rank 3 silent for 2x grace + 1
    post(control, *[syn.summary(r, 3, tp=2, pp=2) for r in (0, 1, 2)])
    fams = families(metrics)
    assert samples(fams["parwatch_rank_up"])[(("rank", "3"),)] == 0
    for name in (
        "parwatch_stage_bubble_ratio",
        "parwatch_stage_idle_seconds_total",
        "parwatch_gpu_power_watts",
        "parwatch_nvml_up",
        "parwatch_collector_dropped_summaries_total",
    ):
        suffix = "_total" if name.endswith("_total") else ""
        assert all(dict(k).get("rank") != "3" for k in samples(fams[name], suffix)), name
    # Stage 1's step histogram is its lowest rank's here, rank 2 (3 steps), before and after rank 3 left.
    counts = {
        s.labels["stage"]: s.value for s in fams["parwatch_step_duration_seconds"].samples if s.name.endswith("_count")
    }
    assert counts == {"0": 3, "1": 3}
    assert samples(fams["parwatch_stage_bubble_ratio"])  # the live ranks remain


def test_status_reports_liveness_with_the_same_clock(env):
    _, control, _, clock = env
    run_steps(control, [1])
    clock.t += GRACE + 0.5
    ranks = control.get("/v1/status").json()["ranks"]
    assert ranks["0"] == {"last_step": 1, "age_seconds": GRACE + 0.5, "up": False}


def test_guardrail_families_follow_the_engine(env, tmp_path):
    sidecar, control, metrics, _ = env
    run_steps(control, [1])
    directive_id = control.post("/v1/control", json={"action": "pause"}).json()["directive_id"]
    r = control.post(
        "/v1/ingest",
        json={
            "version": 1,
            "summaries": [syn.summary(r, 2, tp=2, pp=2) for r in range(4)],
            "outcomes": [syn.outcome(directive_id, step=2, ranks=4)],
        },
    )
    assert r.status_code == 200, r.text
    fams = families(metrics)
    assert samples(fams["parwatch_run_paused"]) == {(): 1}
    actions = samples(fams["parwatch_guardrail_actions_total"], "_total")
    assert actions == {(("action", "pause"), ("rule", "operator")): 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - name: x\n    metric: nope\n")
    sidecar.config = dataclasses.replace(sidecar.config, rules_path=bad)
    assert sidecar.reload_rules() is False
    assert samples(families(metrics)["parwatch_sidecar_rules_reload_failures_total"], "_total") == {(): 1}
    assert "nonfinite-loss" in sidecar.engine.states()  # old rules kept
    good = tmp_path / "good.yaml"
    good.write_text(
        "version: 1\nrules:\n  - name: only-skew\n    metric: pipeline_skew_ratio\n    above: 2\n    action: alert\n"
    )
    sidecar.config = dataclasses.replace(sidecar.config, rules_path=good)
    assert sidecar.reload_rules() is True
    assert set(samples(families(metrics)["parwatch_guardrail_state"])) == {(("rule", "only-skew"),)}


def test_openmetrics_when_asked(env):
    _, control, metrics, _ = env
    run_steps(control, [1])
    r = scrape(metrics, "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n") and "# TYPE parwatch_run info" in r.text
    plain = scrape(metrics)
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE parwatch_run_info gauge" in plain.text


def test_metrics_app_serves_nothing_else(env):
    _, _, metrics, _ = env
    assert metrics.get("/healthz").json() == {"ok": True, "pid": os.getpid()}
    for path in ("/v1/status", "/openapi.json", "/docs"):
        assert metrics.get(path).status_code == 404
    assert metrics.post("/v1/ingest", json={}).status_code in (404, 405)


def test_label_values_that_need_escaping_survive_a_scrape(env):
    _, control, metrics, _ = env
    # Quotes, backslashes and non-ASCII need escaping or encoding (control characters are refused at ingest).
    run_id = 'run "7"\\x\u00e9z'
    post(
        control,
        *[syn.summary(r, 1, tp=2, pp=2, run_id=run_id, global_stages=STAGES if r == 0 else None) for r in range(4)],
    )
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    for accept, parse in (
        ("", text_string_to_metric_families),
        ("application/openmetrics-text; version=1.0.0", openmetrics_families),
    ):
        text = metrics.get("/metrics", headers={"Accept": accept}).text
        info = next(f for f in parse(text) if f.name in ("parwatch_run", "parwatch_run_info"))
        assert info.samples[0].labels["run_id"] == run_id


def test_scrapes_from_another_thread_see_whole_updates(env):
    """/metrics encodes on a worker thread while the loop ingests: histograms must stay consistent."""
    sidecar, _, _, _ = env
    bodies = [
        parse_record(
            {
                "version": 1,
                "summaries": [
                    syn.summary(r, step, tp=2, pp=2, time=float(step), step_seconds=0.05 * (1 + step % 7))
                    for r in range(4)
                ],
            },
            IngestBody,
        )
        for step in range(1, 400)
    ]
    stop = threading.Event()

    def writer():
        for body in bodies:
            sidecar.ingest(body)
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    scrapes = 0
    try:
        while not stop.is_set() or scrapes == 0:
            text = generate_latest(sidecar.registry).decode()
            scrapes += 1
            for fam in text_string_to_metric_families(text):
                if fam.type != "histogram":
                    continue
                series: dict = {}
                for s in fam.samples:
                    key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    series.setdefault(key, {})[s.labels.get("le", s.name.rsplit("_", 1)[1])] = s.value
                for key, values in series.items():
                    buckets = [v for le, v in values.items() if le not in ("count", "sum")]
                    assert buckets == sorted(buckets), (fam.name, key)
                    assert values["+Inf"] == values["count"], (fam.name, key)
    finally:
        thread.join(30)
    assert scrapes > 1


def test_the_bubble_causes_of_rank_0s_view_are_exported_per_stage(env):
    sidecar, control, metrics, _ = env
    stages = [
        dict(st, bubble_schedule_ratio=0.2, bubble_imbalance_ratio=0.05 * i, bubble_wait_ratio=0.01)
        for i, st in enumerate(STAGES)
    ]
    post(control, *[syn.summary(r, 2, tp=2, pp=2, global_stages=stages if r == 0 else None) for r in range(4)])
    fams = families(metrics)
    assert samples(fams["parwatch_stage_bubble_schedule_ratio"]) == {(("stage", "0"),): 0.2, (("stage", "1"),): 0.2}
    assert samples(fams["parwatch_stage_bubble_imbalance_ratio"]) == {(("stage", "0"),): 0.0, (("stage", "1"),): 0.05}
    assert samples(fams["parwatch_stage_bubble_wait_ratio"])[(("stage", "1"),)] == 0.01


def test_the_ledger_and_ml_goodput_step_figures_are_exported(env):
    from parwatch import goodput

    _, control, metrics, _ = env
    step_seconds = [1.2, 1.3, 1.2, 9.0, 1.25, 0.5]  # one straggling step, one under the 1 s floor
    for step, seconds in enumerate(step_seconds, start=1):
        run_steps(control, [step], step_seconds=seconds)
    fams = {f.name: f for f in text_string_to_metric_families(scrape(metrics).text)}
    [ideal] = fams["parwatch_ideal_step_seconds"].samples
    assert ideal.value == pytest.approx(goodput.ideal_step_time(step_seconds))
    assert ideal.value == pytest.approx((1.2 + 1.3 + 1.2 + 1.25) / 4)  # the 9 s step is an outlier
    [deviation] = fams["parwatch_step_time_deviation_seconds"].samples
    assert deviation.value == pytest.approx(goodput.deviation_gauge([abs(t - ideal.value) for t in step_seconds]))
    ledger = {(s.labels["rank"], s.labels["category"]): s.value for s in fams["parwatch_time_seconds"].samples}
    assert len(ledger) == 4 * 15 and ledger[("0", "startup")] == 10.0  # every rank, every category
