"""The shipped Prometheus alert rules: rendered from the default guardrails, valid, and firing right.

promtool checks the syntax of the alerts and of the recording rules they read
(dashboards/recording_rules.yaml), runs dashboards/recording_rules_test.yaml, and runs
dashboards/alerts_test.yaml, where input series make
bubble-excess, stage-skew, rank-missing (and the other defaults) fire and a healthy run fires
nothing. The drift test needs no tool: the file must equal a fresh render, so a threshold
tuned in default_rules.yaml cannot be forgotten in the alerts.
"""

import os
import shutil
import subprocess

import pytest
import yaml

from parwatch.guardrails.alerts import finding_alerts, render_alert_rules, render_alert_rules_yaml
from parwatch.guardrails.rules import default_rules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALERTS = os.path.join(ROOT, "dashboards", "alerts.yaml")
ALERTS_TEST = os.path.join(ROOT, "dashboards", "alerts_test.yaml")
RECORDING = os.path.join(ROOT, "dashboards", "recording_rules.yaml")
RECORDING_TEST = os.path.join(ROOT, "dashboards", "recording_rules_test.yaml")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")


def test_alerts_file_is_a_fresh_render_of_the_default_rules():
    with open(ALERTS, encoding="utf-8") as f:
        text = f.read()
    assert text == render_alert_rules_yaml(default_rules()), (
        "dashboards/alerts.yaml is stale: run `parwatch rules render-alerts -o dashboards/alerts.yaml`"
    )


def test_every_default_rule_has_an_alert_with_its_threshold():
    rules = default_rules()
    alerts = {a["labels"]["rule"]: a for a in render_alert_rules(rules)["groups"][0]["rules"]}
    assert set(alerts) == {r.name for r in rules.rules} | {
        "hang",
        "rank-gone",
        "leader-unreachable",
    }  # + the sidecars' findings
    for rule in rules.rules:
        line = rule.above if rule.above is not None else rule.below if rule.below is not None else rule.factor
        if line is not None:
            assert f"{line:g}" in alerts[rule.name]["expr"], rule.name


def test_alert_tests_expect_the_rendered_labels_and_annotations():
    """alerts_test.yaml copies labels/annotations; name the stale one before promtool's long diff."""
    rendered = {a["alert"]: a for a in yaml.safe_load(open(ALERTS))["groups"][0]["rules"]}
    tests = yaml.safe_load(open(ALERTS_TEST))["tests"]
    for case in (c for t in tests for c in t["alert_rule_test"]):
        for exp in case.get("exp_alerts", []):
            alert = rendered[case["alertname"]]
            assert exp["exp_annotations"] == alert["annotations"], case["alertname"]
            assert {k: exp["exp_labels"][k] for k in alert["labels"]} == alert["labels"], case["alertname"]


@pytest.mark.integration
@needs_promtool
def test_promtool_check_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", ALERTS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(default_rules().rules) + len(finding_alerts())} rules found" in result.stdout


@pytest.mark.integration
@needs_promtool
def test_promtool_test_rules_fire_and_stay_quiet():
    result = subprocess.run(
        [PROMTOOL, "test", "rules", os.path.basename(ALERTS_TEST)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(ALERTS_TEST),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        c["alertname"]
        for t in yaml.safe_load(open(ALERTS_TEST))["tests"]
        for c in t["alert_rule_test"]
        if c.get("exp_alerts")
    }
    assert {"ParwatchBubbleExcess", "ParwatchStageSkew", "ParwatchRankMissing"} <= tested


@pytest.mark.integration
@needs_promtool
def test_promtool_check_recording_rules():
    from parwatch.recording import recordings

    result = subprocess.run([PROMTOOL, "check", "rules", RECORDING], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recordings())} rules found" in result.stdout


@pytest.mark.integration
@needs_promtool
def test_promtool_test_recording_rules():
    result = subprocess.run(
        [PROMTOOL, "test", "rules", os.path.basename(RECORDING_TEST)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(RECORDING_TEST),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
