"""The recording rules (parwatch/recording.py): names, what they read, the checked-in file, and
"one bubble per stage": the recorded stage bubble is the one the guardrail judges (parwatch.bubble).

promtool checks and unit-tests the rules in tests/integration/test_alert_rules.py
(dashboards/recording_rules_test.yaml); VictoriaMetrics answers them in
tests/integration/test_victoriametrics.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from parwatch import bubble, catalog
from parwatch import recording as rec
from parwatch.cli.dashboards import dashboards as dashboards_cli
from parwatch.collector import global_view as gv
from parwatch.collector.stats import breakdown
from parwatch.guardrails.alerts import render_alert_rules
from parwatch.guardrails.rules import REDUCES, Rule, RuleSet, default_rules

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "dashboards" / "recording_rules.yaml"
NAME = re.compile(
    r"^(job|stage|op_group|op_group_reason|cause|rank|rank_gpu|rule|rule_action|post_reason|category|stage_category|part|tracker)"
    r":parwatch_[a-z0-9_]+:[a-z0-9_]+$"
)
RECORDED = re.compile(r"\b[a-z_]+:parwatch_[a-z0-9_]+:[a-z0-9_]+")


def test_checked_in_file_is_a_fresh_render():
    assert RULES_FILE.read_text() == rec.render_recording_rules_yaml(), (
        "dashboards/recording_rules.yaml is stale: run "
        "`parwatch dashboards recording-rules -o dashboards/recording_rules.yaml`"
    )


def test_names_are_level_metric_operations_and_unique():
    names = [r.record for r in rec.recordings()]
    assert len(names) == len(set(names))
    for name in names:
        assert NAME.match(name), f"{name} is not level:metric:operations"
        level, metric, _ = name.split(":")
        base = metric.removesuffix("_bucket")
        if not base.startswith(("parwatch_stage_bubble_excess", "parwatch_rank_state_")):
            assert any(m.name.removesuffix("_total") == base for m in catalog.METRICS), f"{name}: unknown metric"


def test_rules_read_only_catalogue_series_never_recorded_ones():
    """vmalert writes recorded series through remote write: a rule reading one would lag or miss it."""
    for r in rec.recordings():
        assert not RECORDED.search(r.expr), f"{r.record} reads a recorded series: {r.expr}"
        for name in re.findall(r"\bparwatch_[a-z0-9_]+", r.expr):
            catalog.metric(name)


def test_recorded_series_do_not_keep_the_rank_label_except_short_lists():
    for r in rec.recordings():
        level = r.record.split(":")[0]
        if level.startswith("rank"):
            short = {
                rec.RANKS_NOT_RUNNING,
                rec.RANKS_DOWN,
                rec.stragglers_top(),
                rec.GPU_UTIL_BOTTOM,
                rec.SUSPECT_RANKS,
            }
            assert r.record in short, r.record
        else:
            assert "rank" not in level


def test_rate_window_follows_the_argument_and_is_checked():
    two = {r.record for r in rec.recordings("2m")}
    assert (
        "stage:parwatch_stage_idle_seconds:rate2m" in two
        and "op_group:parwatch_collective_duration_seconds:mean2m" in two
    )
    with pytest.raises(ValueError, match="Prometheus duration"):
        rec.recordings("two minutes")


@pytest.mark.parametrize("reduce", REDUCES)
def test_every_alert_reads_recorded_series_that_exist(reduce):
    """Any metric a guardrail may name, with any reduce and window, renders to recorded series."""
    rules = [
        Rule(name=f"r{i}", metric=m, reduce=reduce, above=1.0)
        for i, m in enumerate(
            sorted(
                (
                    "loss",
                    "bubble_ratio",
                    "bubble_excess_ratio",
                    "pipeline_skew_ratio",
                    "collective_seconds_mean",
                    "rank_up",
                    "gpu_utilization_ratio",
                    "step_seconds",
                )
            )
        )
    ]
    rules.append(Rule(name="nan", metric="loss", check="finite", action="rollback"))
    for window in ("1m", "30s"):
        recorded = {r.record for r in rec.recordings(window)}
        doc = render_alert_rules(RuleSet(rules=tuple(rules)), rate_window=window)
        for alert in doc["groups"][0]["rules"]:
            names = RECORDED.findall(alert["expr"])
            assert names, alert
            assert set(names) <= recorded, alert["expr"]
            assert "parwatch_" not in RECORDED.sub("", alert["expr"]), alert["expr"]


def test_default_alerts_render_from_the_recorded_stage_bubble():
    doc = render_alert_rules(default_rules())
    (excess,) = [a for a in doc["groups"][0]["rules"] if a["labels"]["rule"] == "bubble-excess"]
    assert excess["expr"] == f"max by (job) ({rec.stage_bubble_excess()}) > 0.1"


def test_cli_writes_the_rules_and_names_a_bad_window(tmp_path):
    out = tmp_path / "r" / "recording.yaml"
    ok = CliRunner().invoke(dashboards_cli, ["recording-rules", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.read_text() == RULES_FILE.read_text()
    assert yaml.safe_load(out.read_text())["groups"][0]["name"] == rec.GROUP_NAME
    bad = CliRunner().invoke(dashboards_cli, ["recording-rules", "--rate-window", "5 minutes"])
    assert bad.exit_code == 2 and "--rate-window" in bad.output


# --- one bubble per stage ---------------------------------------------------------------------------


def test_recorded_stage_bubble_is_the_one_the_guardrail_judges():
    """tp=2, pp=2: the guardrail's stage bubble (rank 0's global view, from the summed boundary
    vector) is parwatch.bubble's, idle over idle + compute summed over the stage's ranks, which is
    what the recording rule computes from the same counters; with a rank whose optimizer runs long
    (other seconds) it is not the mean of the per-rank ratios."""
    ranks = {
        0: (0, breakdown(1.0, 0.5, 0.1)),
        1: (0, breakdown(1.0, 0.5, 0.4)),  # stage 0: tp ranks 0, 1
        2: (1, breakdown(1.0, 0.8, 0.1)),
        3: (1, breakdown(1.0, 0.6, 0.1)),
    }  # stage 1: tp ranks 2, 3
    summed = [0.0] * gv.slots_for(2)
    for rank, (stage, b) in ranks.items():  # what the SUM all-reduce of every rank's slots gives
        slots = [0.0] * gv.slots_for(2)
        gv.fill_slots(slots, rank=rank, stage=stage, previous=b, previous_step=6)
        summed = [x + y for x, y in zip(summed, slots)]
    view = gv.build_global_view(summed, pp=2, loss=1.0)
    for stage in (0, 1):
        mine = [b for s, b in ranks.values() if s == stage]
        judged = next(s.bubble_ratio for s in view.stages if s.stage == stage)
        # What sum(rate(idle)) / (sum(rate(idle)) + sum(rate(compute))) gives over steps like this one.
        counters = sum(b.idle_seconds for b in mine) / sum(b.idle_seconds + b.compute_seconds for b in mine)
        assert judged == pytest.approx(counters, abs=1e-12)
    ratios = [ranks[r][1].bubble_ratio for r in (0, 1)]
    assert abs(sum(ratios) / 2 - view.stages[0].bubble_ratio) > 0.02  # the old, per-rank mean


def test_recorded_bubble_and_excess_are_the_bubble_modules_promql():
    by_name = {r.record: r.expr for r in rec.recordings("30s")}
    assert by_name[rec.stage_bubble("30s")] == bubble.promql("30s", ("job", "stage"))
    assert by_name[rec.stage_bubble_excess("30s")] == bubble.excess_promql("30s", ("job", "stage"))
    assert "parwatch_stage_bubble_ratio" not in by_name[rec.stage_bubble("30s")]  # not the per-rank gauge
