"""The metric catalogue (parwatch/catalog.py): its conventions, the exporter held to it, and the
series budget per rank counted on a real /metrics (the sidecar's app, in process).

The exporter (parwatch/sidecar/exporter.py) still writes its own names; these tests hold every
name, type and label set it exposes to the catalogue, so it can import the catalogue instead
without a visible change.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from parwatch import catalog
from parwatch.sidecar.app import create_control_app, create_metrics_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn

STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.3)]


def per_rank_series(gpu: bool = True) -> int:
    """Series one rank adds: one label set of every metric labelled by rank (GPU ones only with a GPU)."""
    return sum(
        m.series_per_label_set() * m.label_sets_per_rank()
        for m in catalog.METRICS
        if "rank" in m.labels and (gpu or "gpu" not in m.labels)
    )


def test_names_follow_prometheus_conventions():
    for m in catalog.METRICS:
        assert m.name.startswith("parwatch_") and m.name == m.name.lower(), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.name.endswith("_info") == (m.kind == "info"), m.name
        if m.name.endswith("_ratio"):
            assert m.kind == "gauge" and m.unit == "ratio", m.name
        for unit in ("seconds", "bytes", "watts", "hertz", "celsius"):
            if m.name.removesuffix("_total").endswith("_" + unit):
                assert m.unit == unit, m.name
        assert m.help, f"{m.name} has no help text"
        if m.kind != "info":
            assert set(m.labels) <= catalog.BOUNDED_LABELS, (
                f"{m.name}: unbounded label {set(m.labels) - catalog.BOUNDED_LABELS}"
            )
    assert len({m.name for m in catalog.METRICS}) == len(catalog.METRICS), "a metric is defined twice"


def test_bad_entries_are_refused_with_the_rule_they_break():
    with pytest.raises(ValueError, match="_total"):
        catalog.Metric("parwatch_things", "counter")
    with pytest.raises(ValueError, match="bucket edges"):
        catalog.Metric("parwatch_x_seconds", "histogram")
    with pytest.raises(ValueError, match="kind"):
        catalog.Metric("parwatch_x", "summary")
    with pytest.raises(KeyError, match="parwatch/catalog.py"):
        catalog.metric("parwatch_not_a_metric")
    assert catalog.metric("parwatch_step_duration_seconds_bucket").name == "parwatch_step_duration_seconds"


def test_issue_12_entries_are_catalogued():
    expected = {
        "parwatch_stage_bubble_schedule_ratio": ("gauge", ("stage",)),
        "parwatch_stage_bubble_imbalance_ratio": ("gauge", ("stage",)),
        "parwatch_stage_bubble_wait_ratio": ("gauge", ("stage",)),
        "parwatch_hang_detected": ("gauge", ()),
        "parwatch_rank_state": ("gauge", ("rank",)),
        "parwatch_collective_transfer_seconds": ("histogram", ("op", "group")),
        "parwatch_collective_wait_seconds_total": ("counter", ("op", "group")),
        "parwatch_rank_straggler_seconds_total": ("counter", ("rank",)),
    }
    for name, (kind, labels) in expected.items():
        m = catalog.metric(name)
        assert (m.kind, m.labels) == (kind, labels), name
    assert catalog.RANK_STATES == {"running": 0, "hung": 1, "gone": 2, "unknown": 3}


# --- a real /metrics ---------------------------------------------------------------------------------


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def scrape(tmp_path, ranks: int, tp: int = 2, pp: int = 2, gpu: bool = True) -> str:
    """/metrics of a sidecar that took three steps of a tp x pp x dp run with `ranks` ranks."""
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path / f"state-{ranks}-{gpu}"), clock=Clock())
    auth = {"Authorization": f"Bearer {sidecar.config.token}"}
    control = TestClient(create_control_app(sidecar), headers=auth)
    metrics = TestClient(create_metrics_app(sidecar))
    for step in (1, 2, 3):
        summaries = [
            syn.summary(
                r,
                step,
                tp=tp,
                pp=pp,
                dp=ranks // (tp * pp),
                time=float(step),
                gpu=gpu,
                checkpoints=[1] if step > 1 else [],
                global_stages=STAGES if r == 0 else None,
            )
            for r in range(ranks)
        ]
        summaries[0]["model_flops_utilization_ratio"] = 0.41
        r = control.post("/v1/ingest", json={"version": 1, "summaries": summaries})
        assert r.status_code == 200, r.text
    control.post("/v1/control", json={"action": "pause"})  # a guardrail action counter too
    r = metrics.get("/metrics")
    assert r.status_code == 200
    return r.text


def samples(text: str):
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield fam, s


def test_exporter_output_is_in_the_catalogue(tmp_path):
    """Every family the exporter writes: catalogued, with the catalogue's type and label names."""
    seen = set()
    for fam, s in samples(scrape(tmp_path, 4)):
        m = catalog.metric(s.name)
        # The text format has no info type: an info metric is the gauge NAME_info.
        family, kind = (m.name, "gauge") if m.kind == "info" else (m.family, m.kind)
        assert family == fam.name, f"{s.name}: family {fam.name}, catalogue says {family}"
        assert kind == fam.type, f"{m.name}: exported as {fam.type}, catalogued as {m.kind}"
        labels = set(s.labels) - ({"le"} if s.name.endswith("_bucket") else set())
        assert labels == set(m.labels), f"{s.name}: labels {sorted(labels)}, catalogue says {sorted(m.labels)}"
        if m.kind == "histogram" and s.name.endswith("_bucket"):
            assert s.labels["le"] == "+Inf" or float(s.labels["le"]) in m.buckets, s
        seen.add(m.name)
    # What a CPU-less synthetic run exports today; the collector's new families join at merge.
    assert len(seen) >= 29


def per_rank_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, s in samples(text):
        if "rank" in s.labels:
            counts[s.labels["rank"]] = counts.get(s.labels["rank"], 0) + 1
    return counts


@pytest.mark.parametrize("gpu", [True, False])
def test_series_per_rank_stay_within_the_budget(tmp_path, gpu):
    counts = per_rank_counts(scrape(tmp_path, 4, gpu=gpu))
    assert sorted(counts) == ["0", "1", "2", "3"]
    assert max(counts.values()) <= per_rank_series(gpu) <= catalog.SERIES_BUDGET_PER_RANK, counts


def test_series_without_a_rank_label_do_not_grow_with_ranks(tmp_path):
    """4 ranks and 8 ranks of the same 2 stages: only rank-labelled series are added."""
    small, large = scrape(tmp_path, 4), scrape(tmp_path, 8)

    def unranked(text):
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "dp")))
            for _, s in samples(text)
            if "rank" not in s.labels
        }  # run_info names dp

    assert unranked(small) == unranked(large)
    total = sum(1 for _ in samples(large))
    assert total - len(unranked(large)) == sum(per_rank_counts(large).values()) <= 8 * catalog.SERIES_BUDGET_PER_RANK
