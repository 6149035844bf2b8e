"""Rules files: parsing, every class of validation error (with its line), the CLI, alert rendering."""

import textwrap

import pytest
import yaml
from click.testing import CliRunner

from parwatch.cli.main import cli
from parwatch.guardrails import alerts
from parwatch.guardrails.checks import RuleMonitor
from parwatch.guardrails.rules import Rule, RulesError, RuleSet, default_rules, load_rules, parse_rules
from parwatch.vocabulary import CheckKind, Reduce, RuleAction, RuleState

GOOD = """\
version: 1
enforce: false
defaults:
  cooldown_steps: 30
  no_data_seconds: 90
rollback:
  max_rollbacks: 2
  window_steps: 200
rules:
  - name: skew
    metric: pipeline_skew_ratio
    above: 1.5
    for_steps: 3
    action: alert
  - name: nan
    metric: loss
    check: finite
    action: rollback
    skip_batches: window
    no_data_seconds: null
"""


def problems(text):
    with pytest.raises(RulesError) as info:
        parse_rules(textwrap.dedent(text), "r.yaml")
    return info.value.problems


def only(text):
    found = problems(text)
    assert len(found) == 1, [str(p) for p in found]
    return found[0]


def rules_with(body, top="version: 1\nrules:\n"):
    """A file whose rules start on line 3."""
    return top + textwrap.indent(textwrap.dedent(body), "  ")


def test_good_file_parses_with_defaults_applied():
    rs = parse_rules(GOOD, "good.yaml")
    assert (rs.version, rs.enforce, rs.max_rollbacks, rs.rollback_window_steps, rs.source) == (
        1,
        False,
        2,
        200,
        "good.yaml",
    )
    skew, nan = rs.rules
    assert (skew.check, skew.reduce, skew.for_steps, skew.cooldown_steps, skew.no_data_seconds) == (
        "threshold",
        "max",
        3,
        30,
        90,
    )
    assert skew.line == 10 and nan.line == 15
    assert (nan.check, nan.skip_batches, nan.no_data_seconds) == ("finite", "window", None)
    # The file's words are the vocabulary's members once parsed (what the fields' types say).
    assert (nan.check, skew.reduce, skew.action) == (CheckKind.FINITE, Reduce.MAX, RuleAction.ALERT)
    assert all(type(v) is not str for r in rs.rules for v in (r.check, r.reduce, r.action))


def test_a_restored_monitor_holds_its_state_as_a_member():
    monitor = RuleMonitor(Rule(name="a", metric="loss", above=1.0))
    monitor.restore({"state": "firing"})  # as parwatch.db and decisions.jsonl hold it
    assert monitor.state is RuleState.FIRING


def test_builtin_cooldown_is_raised_to_for_steps():
    rs = parse_rules(rules_with("- {name: a, metric: loss, above: 9, for_steps: 80, action: alert}\n"))
    assert rs.rules[0].cooldown_steps == 80


def test_a_validated_rule_names_its_bound_or_baseline_terms():
    assert Rule(name="a", metric="loss", above=2.5).bound() == ("above", 2.5)
    assert Rule(name="b", metric="loss", below=0.0).bound() == ("below", 0.0)
    spike = Rule(name="c", metric="loss", check="spike", factor=3.0, window_steps=20)
    assert spike.baseline_terms() == (3.0, 20)
    with pytest.raises(ValueError, match="neither 'above' nor 'below'"):
        spike.bound()
    with pytest.raises(ValueError, match="no factor and window_steps"):
        Rule(name="d", metric="loss", check="finite").baseline_terms()


def test_unquoted_exponent_is_a_number():
    rs = parse_rules(rules_with("- {name: a, metric: loss, above: 1e-2, action: alert}\n"))
    assert rs.rules[0].above == 0.01


def test_default_rules_load_and_cover_the_design_rules():
    rs = default_rules()
    names = [r.name for r in rs.rules]
    assert len(names) == len(set(names))
    assert {"nonfinite-loss", "bubble-excess", "stage-skew", "rank-missing"} <= set(names)
    assert rs.rule("nonfinite-loss").action == "rollback"


def test_yaml_syntax_error_names_the_line():
    p = only("version: 1\nrules:\n  - name: a\n    metric: [loss\n")
    assert p.line >= 4 and "not valid YAML" in p.message


def test_empty_file():
    assert "empty" in only("\n").message


def test_top_level_must_be_a_mapping():
    assert "must be a mapping" in problems("- 1\n- 2\n")[0].message


def test_version_must_be_1_and_present():
    p = only("enforce: true\nversion: 2\nrules: []\n")
    assert (p.line, p.field) == (2, "version") and "version: 1" in p.message
    p = only("rules: []\n")
    assert p.field == "version" and "missing" in p.message


def test_unknown_top_level_field_suggests():
    p = only("version: 1\nrules: []\nenforced: true\n")
    assert (p.line, p.field) == (3, "enforced") and "did you mean 'enforce'" in p.message


def test_unknown_rule_field_suggests_closest():
    p = only(rules_with("- name: a\n  metric: loss\n  abov: 0.1\n  below: 1\n  action: alert\n"))
    assert (p.line, p.rule, p.field) == (5, "a", "abov") and "did you mean 'above'" in p.message


def test_unknown_section_field_suggests():
    p = only("version: 1\nrollback:\n  max_rollback: 3\nrules: []\n")
    assert (p.line, p.field) == (3, "max_rollback") and "max_rollbacks" in p.message


@pytest.mark.parametrize("missing", ["name", "metric", "action"])
def test_missing_required_field(missing):
    fields = {"name": "name: a", "metric": "metric: loss", "action": "action: alert"}
    body = "- above: 1\n" + "".join(f"  {v}\n" for k, v in fields.items() if k != missing)
    p = only(rules_with(body))
    assert (p.line, p.field) == (3, missing) and "missing" in p.message


def test_duplicate_names_point_at_both_lines():
    p = only(
        rules_with(
            "- {name: a, metric: loss, above: 1, action: alert}\n- {name: a, metric: loss, below: 0, action: alert}\n"
        )
    )
    assert (p.line, p.rule, p.field) == (4, "a", "name") and "line 3" in p.message


def test_duplicate_key_in_a_rule():
    p = only(rules_with("- name: a\n  metric: loss\n  above: 1\n  action: alert\n  action: pause\n"))
    assert (p.line, p.field) == (7, "action") and "line 6" in p.message


@pytest.mark.parametrize(
    "field,value,hint",
    [
        ("metric", "bubble_excess", "did you mean 'bubble_excess_ratio'"),
        ("check", "finit", "did you mean 'finite'"),
        ("action", "rolback", "did you mean 'rollback'"),
        ("reduce", "avg", "did you mean 'mean'"),
    ],
)
def test_unknown_choice_suggests(field, value, hint):
    rule = {"name": "a", "metric": "loss", "above": 1, "action": "alert", field: value}
    if field == "check":
        del rule["above"]
    body = "- " + "\n  ".join(f"{k}: {v}" for k, v in rule.items()) + "\n"
    p = only(rules_with(body))
    assert p.field == field and p.rule == "a" and hint in p.message
    assert p.line == 3 + list(rule).index(field)


def test_threshold_needs_exactly_one_of_above_below():
    p = only(rules_with("- name: a\n  metric: loss\n  above: 1\n  below: 0\n  action: alert\n"))
    assert p.field == "above" and "both" in p.message and p.line == 5
    p = only(rules_with("- name: a\n  metric: loss\n  action: alert\n"))
    assert p.field == "above" and "neither" in p.message and p.line == 3


@pytest.mark.parametrize("check", ["spike", "regression"])
def test_spike_and_regression_need_factor_and_window(check):
    found = problems(
        rules_with(f"- name: a\n  metric: loss\n  check: {check}\n  factor: 1.0\n  window_steps: 1\n  action: alert\n")
    )
    assert {(p.field, p.line) for p in found} == {("factor", 6), ("window_steps", 7)}
    found = problems(rules_with(f"- name: a\n  metric: loss\n  check: {check}\n  action: alert\n"))
    assert {p.field for p in found} == {"factor", "window_steps"}


def test_min_increase_is_the_regressions_and_not_negative():
    p = only(
        rules_with(
            "- {name: a, metric: loss, check: spike, factor: 2, window_steps: 5, min_increase: 1, action: alert}\n"
        )
    )
    assert p.field == "min_increase" and "only the regression check" in p.message
    p = only(
        rules_with(
            "- {name: a, metric: loss, check: regression, factor: 2, window_steps: 5, min_increase: -1, action: alert}\n"
        )
    )
    assert p.field == "min_increase" and ">= 0" in p.message


def test_fields_of_other_checks_are_rejected():
    p = only(rules_with("- {name: a, metric: loss, above: 1, factor: 2, action: alert}\n"))
    assert p.field == "factor" and "spike and regression" in p.message
    p = only(rules_with("- {name: a, metric: loss, check: finite, below: 1, action: alert}\n"))
    assert p.field == "below"


def test_for_steps_at_least_one():
    p = only(rules_with("- name: a\n  metric: loss\n  above: 1\n  for_steps: 0\n  action: alert\n"))
    assert (p.field, p.line) == ("for_steps", 6)


def test_cooldown_must_cover_for_steps():
    p = only(
        rules_with("- name: a\n  metric: loss\n  above: 1\n  for_steps: 10\n  cooldown_steps: 5\n  action: alert\n")
    )
    assert (p.field, p.line) == ("cooldown_steps", 7) and "cooldown_steps: 10" in p.message


def test_cooldown_inherited_from_defaults_points_at_defaults():
    p = only(
        "version: 1\ndefaults:\n  cooldown_steps: 5\nrules:\n"
        "  - {name: a, metric: loss, above: 1, for_steps: 10, action: alert}\n"
    )
    assert (p.field, p.line, p.rule) == ("cooldown_steps", 3, "a") and "inherited from defaults" in p.message


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("for_steps", '"ten"', "whole number"),
        ("above", "high", "number"),
        ("name", "[a, b]", "a word"),
        ("no_data_seconds", "soon", "or null"),
        ("skip_batches", "all", "or window"),
    ],
)
def test_wrong_types(field, value, expected):
    rule = {"name": "a", "metric": "loss", "above": "1", "action": "rollback", field: value}
    body = "- " + "\n  ".join(f"{k}: {v}" for k, v in rule.items()) + "\n"
    p = only(rules_with(body))
    assert p.field == field and expected in p.message
    assert p.line == 3 + list(rule).index(field)


def test_enforce_must_be_bool():
    p = only("version: 1\nenforce: maybe\nrules: []\n")
    assert (p.field, p.line) == ("enforce", 2)


def test_rules_must_be_a_list():
    p = only("version: 1\nrules:\n  name: a\n")
    assert p.field == "rules"


def test_skip_batches_only_for_rollback():
    p = only(rules_with("- {name: a, metric: loss, above: 1, action: pause, skip_batches: 3}\n"))
    assert p.field == "skip_batches" and "rollback" in p.message


def test_rollback_section_values_checked():
    p = only("version: 1\nrollback:\n  window_steps: 0\nrules: []\n")
    assert (p.field, p.line) == ("rollback.window_steps", 3)


def test_all_problems_are_collected_and_formatted():
    text = rules_with(
        "- {name: a, metric: los, above: 1, action: alert}\n"
        "- {name: b, metric: loss, above: 1, action: explode}\n"
        "- {name: c, metric: loss, above: 1, for_steps: 0, action: alert}\n"
    )
    with pytest.raises(RulesError) as info:
        parse_rules(text, "f.yaml")
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("f.yaml:3: rule 'a': field 'metric': unknown metric 'los'")
    assert lines[1].startswith("f.yaml:4: rule 'b': field 'action':")
    assert lines[2].startswith("f.yaml:5: rule 'c': field 'for_steps':")


def test_rules_built_in_code_are_checked_at_construction():
    with pytest.raises(RulesError, match="cooldown_steps"):
        Rule(name="a", metric="loss", above=1.0, for_steps=10, cooldown_steps=3)
    rule = Rule(name="a", metric="loss", above=1.0)
    with pytest.raises(RulesError, match="duplicate name"):
        RuleSet(rules=(rule, rule))


def test_load_rules_missing_file(tmp_path):
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(tmp_path / "nope.yaml")


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_check_ok(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(GOOD)
    result = CliRunner().invoke(cli, ["rules", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "ok: 2 rules (enforce=false)"


def test_cli_check_prints_every_problem_and_exits_1(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        rules_with(
            "- {name: a, metric: los, above: 1, action: alert}\n- {name: b, metric: loss, above: 1, action: explode}\n"
        )
    )
    result = CliRunner().invoke(cli, ["rules", "check", str(path)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{path}:") for line in lines)


def test_cli_help_has_an_example():
    result = CliRunner().invoke(cli, ["rules", "check", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "parwatch rules check" in result.output


def test_cli_render_alerts_writes_the_rendered_rules(tmp_path):
    path, out = tmp_path / "r.yaml", tmp_path / "alerts.yaml"
    path.write_text(GOOD)
    result = CliRunner().invoke(cli, ["rules", "render-alerts", str(path), "-o", str(out), "--step-seconds", "2"])
    assert result.exit_code == 0, result.output
    expected = alerts.render_alert_rules_yaml(parse_rules(GOOD, str(path)), step_seconds=2)
    assert out.read_text() == expected
    doc = yaml.safe_load(out.read_text())
    skew = doc["groups"][0]["rules"][0]
    assert skew["for"] == "4s"  # for_steps 3 -> 2 step periods of 2 s


# -- alert rendering ---------------------------------------------------------------------------------


def test_render_maps_rules_to_promql_with_severity_and_for():
    rs = parse_rules(GOOD)
    doc = alerts.render_alert_rules(rs, runbook_base="https://x/runbook.md", step_seconds=10)
    skew, nan, hang, gone, unreachable = doc["groups"][0]["rules"]
    assert skew["alert"] == "ParwatchSkew"
    # Then the sidecars' findings outside the rules file, on recorded series too.
    assert (hang["alert"], gone["alert"]) == ("ParwatchHang", "ParwatchRankGone")
    assert hang["expr"] == "max by (job) (job:parwatch_hang_detected:max) > 0"
    assert hang["annotations"]["runbook_url"] == "https://x/runbook.md#hang" and "for" not in hang
    assert unreachable["expr"] == "max by (job) (job:parwatch_leader_unreachable_since_timestamp_seconds:max) > 0"
    assert unreachable["for"] == "30s"
    assert unreachable["annotations"]["runbook_url"] == "https://x/runbook.md#leader-unreachable"
    # Alerts read recorded series (parwatch/recording.py), never per-rank ones.
    assert skew["expr"] == "max by (job) (job:parwatch_pipeline_skew_ratio:max) > 1.5"
    assert skew["for"] == "20s"
    assert skew["labels"] == {"severity": "warning", "parwatch_action": "alert", "rule": "skew"}
    assert skew["annotations"]["runbook_url"] == "https://x/runbook.md#skew"
    assert nan["labels"]["severity"] == "page" and "for" not in nan
    # The 0/1 flag, not `loss != loss`: VictoriaMetrics drops NaN samples (docs/deploy.md).
    assert nan["expr"] == "job:parwatch_loss_nonfinite:max > 0"


def test_render_for_uses_the_longer_of_steps_and_seconds():
    rule = Rule(name="a", metric="rank_up", reduce="min", below=1, for_steps=4, for_seconds=60)
    assert alerts.for_seconds(rule, 10) == 60
    assert alerts.for_seconds(rule, 30) == 90
    assert [alerts.format_duration(s) for s in (0, 0.5, 60, 190, 3600)] == ["0s", "500ms", "1m", "3m10s", "1h"]


def test_render_skips_a_rule_without_prometheus_metric_with_a_comment(monkeypatch):
    monkeypatch.delitem(alerts.METRIC_EXPRESSIONS, "pipeline_skew_ratio")
    text = alerts.render_alert_rules_yaml(parse_rules(GOOD))
    assert text.startswith(alerts.HEADER)
    assert "# rule 'skew' skipped: no Prometheus metric carries pipeline_skew_ratio" in text
    assert [r["alert"] for r in yaml.safe_load(text)["groups"][0]["rules"]] == [
        "ParwatchNan",
        "ParwatchHang",
        "ParwatchRankGone",
        "ParwatchLeaderUnreachable",
    ]
