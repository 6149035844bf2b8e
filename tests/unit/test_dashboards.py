"""The Grafana dashboard's structure, its metric names, and pushing it.

Grafana itself cannot run here: pushing is tested against a fake with grafana-client's
GrafanaApi interface (folder.get_folder/create_folder, dashboard.update_dashboard) that raises
grafana-client's own exceptions. The PromQL runs against a real Prometheus in
tests/integration/test_dashboard_queries.py.
"""

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from grafana_client.client import GrafanaClientError

from parwatch import catalog
from parwatch import dashboards as dash
from parwatch import recording as rec
from parwatch.cli.dashboards import dashboards as dashboards_cli
from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_FILE = ROOT / "dashboards" / "parwatch.json"
PANEL_TYPES = {"timeseries", "stat", "bargauge", "heatmap"}
GRAFANA_VARIABLES = {"$__range", "$__range_s", "$price_per_gpu_hour", "$job"}
RECORDED = re.compile(r"\b[a-z_]+:parwatch_[a-z0-9_]+:[a-z0-9_]+")


@pytest.fixture(scope="module")
def board():
    return dash.build_dashboard()


def exprs(board):
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_checked_in_file_is_the_builders_output(board):
    assert json.loads(DASHBOARD_FILE.read_text()) == json.loads(json.dumps(board)), (
        "dashboards/parwatch.json is stale: run `parwatch dashboards export -o dashboards/parwatch.json`"
    )


def test_schema_version_and_datasource_variable(board):
    assert 39 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    price = variables["price_per_gpu_hour"]
    assert price["type"] in {"textbox", "constant"}
    assert float(price["query"]) == DEFAULT_PRICE_PER_GPU_HOUR
    # ${DS_PROMETHEUS}-style inputs break file and sidecar provisioning.
    assert "DS_PROMETHEUS" not in json.dumps(board) and "__inputs" not in board


def test_price_variable_default_follows_the_argument():
    price = {v["name"]: v for v in dash.build_dashboard(price_per_gpu_hour=4.2)["templating"]["list"]}
    assert price["price_per_gpu_hour"]["query"] == "4.2"


def test_every_panel_and_target_uses_the_datasource_variable(board):
    for p in board["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_panel_ids_unique_types_known(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {p["type"] for p in board["panels"]} <= PANEL_TYPES
    for p in board["panels"]:
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]


def test_grid_positions_fit_and_do_not_overlap(board):
    taken = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in g.values())
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


def test_every_query_reads_only_recorded_series(board):
    """A panel over per-rank series would read every rank's series at each refresh."""
    recorded = {r.record for r in rec.recordings()}
    for expr in exprs(board):
        for name in RECORDED.findall(expr):
            assert name in recorded, f"{name} is not a recording rule (parwatch/recording.py): {expr}"
        assert "parwatch_" not in RECORDED.sub("", expr), f"reads a raw series instead of a recorded one: {expr}"


def test_a_dashboard_for_another_rate_window_reads_that_windows_recordings():
    board = dash.build_dashboard(rate_window="2m")
    recorded = {r.record for r in rec.recordings("2m")}
    names = {name for expr in exprs(board) for name in RECORDED.findall(expr)}
    assert names <= recorded, names - recorded
    assert any(name.endswith("rate2m") for name in names)


def test_cli_export_names_a_bad_rate_window():
    result = CliRunner().invoke(dashboards_cli, ["export", "--rate-window", "a minute"])
    assert result.exit_code == 2 and "--rate-window" in result.output


def test_every_recorded_series_is_read_for_the_chosen_run(board):
    """Recorded series keep the scrape job (one per run): each panel reads the run in $job only."""
    variables = {v["name"]: v for v in board["templating"]["list"]}
    job = variables["job"]
    assert job["type"] == "query" and job["query"] == f"label_values({rec.job('parwatch_train_step', 'max')}, job)"
    assert job["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and job["multi"] is False
    for expr in exprs(board):
        for m in RECORDED.finditer(expr):
            assert expr[m.end() :].startswith(('{job=~"$job"}', '{job=~"$job",')), expr


def test_every_catalogue_metric_reaches_a_panel(board):
    """Through the recording rules the dashboard reads: a metric no panel shows is a metric nobody sees."""
    used = {name for expr in exprs(board) for name in RECORDED.findall(expr)}
    shown = set()
    for r in rec.recordings():
        if r.record in used:
            shown |= {catalog.metric(n).name for n in re.findall(r"\bparwatch_[a-z0-9_]+", r.expr)}
    # A rank's own newest-step bubble stays exported for per-rank queries; no panel draws it, so no
    # second bubble line sits next to the stage bubble the guardrail judges (parwatch.bubble).
    per_rank_only = {"parwatch_stage_bubble_ratio"}
    assert {m.name for m in catalog.METRICS} - shown == per_rank_only, "catalogue metrics without a panel"


def test_bubble_panels_and_alerts_read_the_recorded_stage_bubble(board):
    """One bubble per stage: the panel draws and the alert judges the same recorded series."""
    excess = _panel(board, "Bubble excess (measured - theoretical)")
    assert [t["expr"] for t in excess["targets"]] == [dash.for_run(rec.stage_bubble_excess())]
    assert _panel(board, "Bubble ratio per stage vs theoretical")["targets"][0]["expr"] == dash.for_run(
        rec.stage_bubble()
    )
    alerts = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())["groups"][0]["rules"]
    (alert,) = [a for a in alerts if a["labels"]["rule"] == "bubble-excess"]
    assert rec.stage_bubble_excess() in alert["expr"]


def test_queries_only_use_known_variables(board):
    for expr in exprs(board):
        assert set(re.findall(r"\$\w+", expr)) <= GRAFANA_VARIABLES, expr


def test_histograms_are_read_from_buckets(board):
    heatmaps = [p for p in board["panels"] if p["type"] == "heatmap"]
    assert heatmaps
    for p in heatmaps:
        (t,) = p["targets"]
        assert t["format"] == "heatmap" and "parwatch_collective_duration_seconds_bucket" in t["expr"]
        assert "by (le)" in t["expr"] and p["options"]["calculate"] is False
    quantiles = [e for e in exprs(board) if "histogram_quantile(0.99" in e]
    buckets = rec.bucket_rate_name("op_group", "parwatch_collective_duration_seconds")
    assert f"histogram_quantile(0.99, {dash.for_run(buckets)})" in quantiles
    assert "sum by (job, op, group, le)" in {r.record: r.expr for r in rec.recordings()}[buckets]


def _panel(board, title):
    (p,) = [p for p in board["panels"] if p["title"] == title]
    return p


def test_threshold_lines_come_from_the_default_guardrails(board):
    excess = _panel(board, "Bubble excess (measured - theoretical)")
    assert excess["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == dash.rule_threshold(
        "bubble-excess", "above"
    )
    assert _panel(board, "Pipeline skew")["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 1.25


def test_thresholds_follow_an_edited_rules_file(tmp_path):
    text = dash.DEFAULT_RULES.read_text().replace("above: 1.25", "above: 1.5")
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    board = dash.build_dashboard(rules_path=rules)
    assert _panel(board, "Pipeline skew")["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 1.5


def test_missing_rule_names_the_rule(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules: []\n")
    with pytest.raises(KeyError, match="stage-skew|bubble-excess"):
        dash.build_dashboard(rules_path=rules)


# --- pushing, against a fake GrafanaApi -------------------------------------------------------------


class FakeFolders:
    def __init__(self, existing=(), error_status=None):
        self.uids = set(existing)
        self.error_status = error_status
        self.created = []

    def get_folder(self, uid):
        if self.error_status:
            raise GrafanaClientError(self.error_status, None, f"Client Error {self.error_status}")
        if uid not in self.uids:
            raise GrafanaClientError(404, None, "Client Error 404: folder not found")
        return {"uid": uid}

    def create_folder(self, title, uid=None, parent_uid=None):
        self.created.append((title, uid))
        self.uids.add(uid)
        return {"uid": uid, "title": title}


class FakeDashboards:
    def __init__(self):
        self.bodies = []

    def update_dashboard(self, dashboard):
        self.bodies.append(dashboard)
        return {"status": "success", "uid": dashboard["dashboard"]["uid"], "url": "/d/parwatch/parwatch"}


class FakeGrafanaApi:
    def __init__(self, folders=None):
        self.folder = folders or FakeFolders()
        self.dashboard = FakeDashboards()


def test_push_creates_a_missing_folder_then_overwrites_the_dashboard():
    api = FakeGrafanaApi()
    dash.push_dashboard(api, folder_uid="ml", folder_title="ML runs")
    assert api.folder.created == [("ML runs", "ml")]
    (body,) = api.dashboard.bodies
    assert body["folderUid"] == "ml" and body["overwrite"] is True
    assert body["dashboard"]["uid"] == "parwatch" and body["dashboard"]["id"] is None
    dash.push_dashboard(api, folder_uid="ml")  # second push: folder now exists
    assert len(api.folder.created) == 1 and len(api.dashboard.bodies) == 2


def test_push_surfaces_errors_other_than_a_missing_folder():
    api = FakeGrafanaApi(FakeFolders(error_status=403))
    with pytest.raises(GrafanaClientError):
        dash.push_dashboard(api)
    assert api.dashboard.bodies == []


def test_connect_builds_a_token_authenticated_client():
    api = dash.connect("http://grafana.example:3000", "secret-token")
    assert (api.client.url_host, api.client.url_port) == ("grafana.example", 3000)
    assert type(api.client.auth).__name__ == "TokenAuth"


def test_cli_export_writes_the_dashboard(tmp_path):
    out = tmp_path / "d" / "board.json"
    result = CliRunner().invoke(dashboards_cli, ["export", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == json.loads(DASHBOARD_FILE.read_text())


def test_cli_push_reads_the_token_file_and_uses_the_folder(tmp_path):
    seen, api = {}, FakeGrafanaApi()

    def connect(url, token):
        seen.update(url=url, token=token)
        return api

    token = tmp_path / "token"
    token.write_text("glsa_abc\n")
    result = CliRunner().invoke(
        dashboards_cli,
        ["push", "--url", "http://g:3000", "--token-file", str(token), "--folder-uid", "team"],
        obj={"grafana_connect": connect},
    )
    assert result.exit_code == 0, result.output
    assert seen == {"url": "http://g:3000", "token": "glsa_abc"}
    assert api.dashboard.bodies[0]["folderUid"] == "team"


def test_cli_push_token_from_env_and_clear_error_without_one(monkeypatch):
    tokens = []

    def connect(url, token):
        tokens.append(token)
        return FakeGrafanaApi()

    runner = CliRunner()
    ok = runner.invoke(
        dashboards_cli,
        ["push", "--url", "http://g:3000"],
        obj={"grafana_connect": connect},
        env={"GRAFANA_TOKEN": "from-env"},
    )
    assert ok.exit_code == 0 and tokens == ["from-env"]
    missing = runner.invoke(
        dashboards_cli, ["push", "--url", "http://g:3000"], obj={"grafana_connect": connect}, env={"GRAFANA_TOKEN": ""}
    )
    assert missing.exit_code == 2 and "--token-file" in missing.output and tokens == ["from-env"]
