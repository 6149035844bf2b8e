"""parwatch's own cost, measured where it is spent: span hooks on the training thread (HookRegistry.hook_ns),
the collector's boundary work, the shipper's and the activity reporter's threads; carried in every summary
as cumulative seconds by part and exported as parwatch_self_seconds_total{rank, part}."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from parwatch.contract import HookRegistry, Observer, SpanKind
from parwatch.integrations import _stage_spans
from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.vocabulary import SelfPart
from tests.fixtures import synthetic as syn

BODY_S = 0.02


class Sink(Observer):
    def __init__(self):
        self.spans = []
        self.on_span = self.spans.append


def _observed() -> tuple[HookRegistry, Sink]:
    reg = HookRegistry()
    sink = Sink()
    reg.register(sink)
    return reg, sink


def test_unobserved_spans_cost_nothing_and_add_nothing():
    reg = HookRegistry()
    for _ in range(10):
        with reg.span(SpanKind.FORWARD, stage=0):
            pass
    assert reg.hook_ns == 0


def test_span_hooks_are_counted_without_the_work_they_wrap():
    reg, sink = _observed()
    for mb in range(5):
        with reg.span(SpanKind.FORWARD, stage=0, microbatch=mb):
            time.sleep(BODY_S)
    assert len(sink.spans) == 5
    assert 0 < reg.hook_ns < 5 * BODY_S * 1e9 / 10, reg.hook_ns  # a sleep inside is never the hooks'
    before = reg.hook_ns
    reg.unregister(sink)
    with reg.span(SpanKind.FORWARD, stage=0):
        pass
    assert reg.hook_ns == before  # detached: nothing observed, nothing counted


def test_the_torch_pipelining_wrapper_counts_into_the_same_registry(monkeypatch):
    reg, sink = _observed()
    monkeypatch.setattr(_stage_spans, "registry", reg)
    calls = []

    def forward_one_chunk(chunk_id):
        calls.append(chunk_id)
        time.sleep(BODY_S)

    timed = _stage_spans._timed(forward_one_chunk, SpanKind.FORWARD, _stage_spans._AttrsByMicrobatch({"stage": 0}))
    for mb in range(4):
        timed(mb)
    assert calls == [0, 1, 2, 3] and len(sink.spans) == 4
    assert 0 < reg.hook_ns < 4 * BODY_S * 1e9 / 10, reg.hook_ns


def test_summaries_carry_self_seconds_and_metrics_export_them_by_rank_and_part(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / "state"))
    control = TestClient(create_control_app(sidecar), headers={"Authorization": f"Bearer {sidecar.config.token}"})
    metrics = TestClient(create_metrics_app(sidecar))
    summaries = []
    for rank in range(2):
        s = syn.summary(rank, 1, pp=2)
        s["self_seconds"] = {part.value: 0.001 * (rank + 1) * (i + 1) for i, part in enumerate(SelfPart)}
        summaries.append(s)
    assert control.post("/v1/ingest", json={"version": 1, "summaries": summaries}).status_code == 200
    got = {}
    for family in text_string_to_metric_families(metrics.get("/metrics").text):
        if family.name == "parwatch_self_seconds":
            assert family.type == "counter"
            got = {(s.labels["rank"], s.labels["part"]): s.value for s in family.samples if s.name.endswith("_total")}
    assert got == {
        (str(rank), part.value): 0.001 * (rank + 1) * (i + 1) for rank in range(2) for i, part in enumerate(SelfPart)
    }


def test_the_report_shows_self_cost_as_a_share_of_the_step(tmp_path):
    import json

    from parwatch.report.build import build_report
    from parwatch.report.stats import self_cost_shares

    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for step in range(1, 4):
        for rank in range(2):
            s = syn.summary(rank, step, pp=2, step_seconds=1.0)
            s["process_start_time"] = 100.0
            s["self_seconds"] = {
                SelfPart.HOOKS: 0.002 * step,
                SelfPart.COLLECTOR: 0.001 * step,
                SelfPart.SHIPPER: 0.004 * step,
                SelfPart.ACTIVITY: 0.0,
            }
            rows.append(s)
    (run / "summaries.jsonl").write_text("".join(json.dumps(s) + "\n" for s in rows))
    shares = self_cost_shares(rows)  # each rank: steps 2 and 3 (2 s) cost 2 x the per-step growth
    assert shares is not None
    assert shares[SelfPart.HOOKS] == pytest.approx(0.002) and shares[SelfPart.SHIPPER] == pytest.approx(0.004)
    assert shares["training_thread"] == pytest.approx(0.003)
    markdown = build_report(run)["markdown"].read_text()
    assert "parwatch's own cost" in markdown and "| training thread | 0.3% |" in markdown, markdown
