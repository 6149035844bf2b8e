"""The recording rules (parwatch/recording.py): names, what they read, the checked-in file, and
"one bubble per stage": the recorded stage bubble is the mean the guardrail judges.

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

from parwatch import catalog
from parwatch import recording as rec
from parwatch.cli.dashboards import dashboards as dashboards_cli
from parwatch.collector import global_view as gv
from parwatch.collector.stats import breakdown
from parwatch.guardrails.alerts import render_alert_rules
from parwatch.guardrails.rules import REDUCES, Rule, RuleSet, default_rules

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "dashboards" / "recording_rules.yaml"
NAME = re.compile(r"^(job|stage|op_group|op_group_reason|cause|rank|rank_gpu|rule|rule_action|post_reason)"
                  r":parwatch_[a-z0-9_]+:[a-z0-9_]+$")
RECORDED = re.compile(r"\b[a-z_]+:parwatch_[a-z0-9_]+:[a-z0-9_]+")


def test_checked_in_file_is_a_fresh_render():
    assert RULES_FILE.read_text() == rec.render_recording_rules_yaml(), (
        "dashboards/recording_rules.yaml is stale: run "
        "`parwatch dashboards recording-rules -o dashboards/recording_rules.yaml`")


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
            assert r.record in {rec.RANKS_NOT_RUNNING, rec.RANKS_DOWN, rec.stragglers_top(), rec.GPU_UTIL_BOTTOM}, r.record
        else:
            assert "rank" not in level


def test_rate_window_follows_the_argument_and_is_checked():
    two = {r.record for r in rec.recordings("2m")}
    assert "stage:parwatch_stage_idle_seconds:rate2m" in two and "op_group:parwatch_collective_duration_seconds:mean2m" in two
    with pytest.raises(ValueError, match="Prometheus duration"):
        rec.recordings("two minutes")


@pytest.mark.parametrize("reduce", REDUCES)
def test_every_alert_reads_recorded_series_that_exist(reduce):
    """Any metric a guardrail may name, with any reduce and window, renders to recorded series."""
    rules = [Rule(name=f"r{i}", metric=m, reduce=reduce, above=1.0) for i, m in enumerate(sorted(
        ("loss", "bubble_ratio", "bubble_excess_ratio", "pipeline_skew_ratio", "collective_seconds_mean",
         "rank_up", "gpu_utilization_ratio", "step_seconds")))]
    rules.append(Rule(name="nan", metric="loss", check="finite", action="rollback"))
    for window in ("1m", "30s"):
        recorded = rec.recorded_names(window)
        doc = render_alert_rules(RuleSet(rules=tuple(rules)), rate_window=window)
        for alert in doc["groups"][0]["rules"]:
            names = RECORDED.findall(alert["expr"])
            assert names, alert
            assert set(names) <= recorded, alert["expr"]
            assert "parwatch_" not in RECORDED.sub("", alert["expr"]), alert["expr"]


def test_default_alerts_render_from_the_recorded_stage_bubble():
    doc = render_alert_rules(default_rules())
    (excess,) = [a for a in doc["groups"][0]["rules"] if a["labels"]["rule"] == "bubble-excess"]
    assert excess["expr"] == f"max by (job) ({rec.STAGE_BUBBLE_EXCESS}) > 0.1"


def test_cli_writes_the_rules_and_names_a_bad_window(tmp_path):
    out = tmp_path / "r" / "recording.yaml"
    ok = CliRunner().invoke(dashboards_cli, ["recording-rules", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.read_text() == RULES_FILE.read_text()
    assert yaml.safe_load(out.read_text())["groups"][0]["name"] == rec.GROUP_NAME
    bad = CliRunner().invoke(dashboards_cli, ["recording-rules", "--rate-window", "5 minutes"])
    assert bad.exit_code == 2 and "--rate-window" in bad.output


# --- one bubble per stage ---------------------------------------------------------------------------


def test_recorded_stage_bubble_is_the_mean_the_guardrail_judges():
    """tp=2, pp=2: the guardrail's stage bubble (rank 0's global view, from the summed boundary
    vector) equals the mean of the per-rank bubbles the exporter writes, which is what
    stage:parwatch_stage_bubble_ratio:avg records. A stage's ranks share the step period (the
    boundary collective ends it on all of them) and their other seconds (optimizer, DP sync), so
    the mean of their ratios is the ratio of their mean idle and busy times."""
    ranks = {0: (0, breakdown(1.0, 0.5, 0.1)), 1: (0, breakdown(1.0, 0.7, 0.1)),   # stage 0: tp ranks 0, 1
             2: (1, breakdown(1.0, 0.8, 0.1)), 3: (1, breakdown(1.0, 0.6, 0.1))}   # stage 1: tp ranks 2, 3
    summed = [0.0] * gv.slots_for(2)
    for rank, (stage, b) in ranks.items():  # what the SUM all-reduce of every rank's slots gives
        slots = [0.0] * gv.slots_for(2)
        gv.fill_slots(slots, rank=rank, stage=stage, previous=b, previous_step=6)
        summed = [x + y for x, y in zip(summed, slots)]
    view = gv.build_global_view(summed, pp=2, loss=1.0)
    for stage in (0, 1):
        exported = [b.bubble_ratio for s, b in ranks.values() if s == stage]  # parwatch_stage_bubble_ratio per rank
        judged = next(s["bubble_ratio"] for s in view["stages"] if s["stage"] == stage)
        assert sum(exported) / len(exported) == pytest.approx(judged, abs=1e-12)
    # And not the max over the stage's ranks, which the dashboard drew before.
    assert max(ranks[0][1].bubble_ratio, ranks[1][1].bubble_ratio) > view["stages"][0]["bubble_ratio"]
