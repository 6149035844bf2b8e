"""Every alert's runbook_url lands on a section of docs/runbook.md, and every default rule has one."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from parwatch.guardrails.rules import default_rules

ROOT = Path(__file__).resolve().parents[2]


def _anchors() -> set[str]:
    return set(re.findall(r'<a id="([^"]+)"></a>', (ROOT / "docs/runbook.md").read_text()))


def test_every_alert_runbook_url_has_an_anchor():
    alerts = yaml.safe_load((ROOT / "dashboards/alerts.yaml").read_text())
    urls = [r["annotations"]["runbook_url"] for g in alerts["groups"] for r in g["rules"] if "alert" in r]
    assert urls, "no alert rules rendered"
    missing = [u for u in urls if u.split("#", 1)[1] not in _anchors()]
    assert not missing, f"runbook_url anchors without a section in docs/runbook.md: {missing}"


def test_every_default_rule_has_a_runbook_section():
    assert {r.name for r in default_rules().rules} <= _anchors()
