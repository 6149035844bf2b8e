"""The Grafana dashboard: built in code, exported to dashboards/parwatch.json, pushed with grafana-client.

The panels are data (title, kind, PromQL, unit, size) and a flow layout places them, so adding a
panel is one line. Metric names come from METRICS, the catalogue of DESIGN.md; a unit test holds
every query to it. Thresholds drawn on panels are read from the packaged default guardrails, so a
line on the dashboard and the rule that acts on it never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

DASHBOARD_UID = "parwatch"
DEFAULT_FOLDER_UID = "parwatch"
DEFAULT_PRICE_PER_GPU_HOUR = 2.5
DEFAULT_RULES = Path(__file__).parent / "sidecar" / "default_rules.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@dataclass(frozen=True)
class Metric:
    name: str
    """Name as exposed: counters end in _total, info metrics in _info, histograms add _bucket/_sum/_count."""
    kind: str
    """gauge | counter | histogram | info."""
    labels: tuple[str, ...] = ()
    """Label names (bounded: never a step, microbatch or run id)."""

    def series(self) -> tuple[str, ...]:
        """The series names this metric exposes."""
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


_RS, _RG, _OG = ("rank", "stage"), ("rank", "gpu"), ("op", "group")
METRICS: tuple[Metric, ...] = (
    Metric("parwatch_run_info", "info", ("run_id", "schedule", "tp", "pp", "dp", "microbatches", "version")),
    Metric("parwatch_train_step", "gauge"),
    Metric("parwatch_loss", "gauge"),
    Metric("parwatch_tokens_total", "counter"),
    Metric("parwatch_model_flops_utilization_ratio", "gauge", ("rank",)),
    Metric("parwatch_torch_memory_max_allocated_bytes", "gauge", _RS),
    Metric("parwatch_step_duration_seconds", "histogram", _RS),
    Metric("parwatch_stage_compute_seconds_total", "counter", _RS),
    Metric("parwatch_stage_idle_seconds_total", "counter", _RS),
    Metric("parwatch_stage_bubble_ratio", "gauge", _RS),
    Metric("parwatch_stage_bubble_theoretical_ratio", "gauge", ("stage",)),
    Metric("parwatch_pipeline_skew_ratio", "gauge"),
    Metric("parwatch_collective_duration_seconds", "histogram", _OG),
    Metric("parwatch_collective_bytes_total", "counter", _OG),
    Metric("parwatch_collective_busbw_bytes_per_second", "gauge", _OG),
    Metric("parwatch_gpu_utilization_ratio", "gauge", _RG),
    Metric("parwatch_gpu_memory_used_bytes", "gauge", _RG),
    Metric("parwatch_gpu_power_watts", "gauge", _RG),
    Metric("parwatch_gpu_sm_clock_hertz", "gauge", _RG),
    Metric("parwatch_gpu_temperature_celsius", "gauge", _RG),
    Metric("parwatch_nvml_up", "gauge", ("rank",)),
    Metric("parwatch_rank_up", "gauge", ("rank",)),
    Metric("parwatch_guardrail_state", "gauge", ("rule",)),
    Metric("parwatch_guardrail_actions_total", "counter", ("rule", "action")),
    Metric("parwatch_run_paused", "gauge"),
    Metric("parwatch_checkpoint_last_good_step", "gauge"),
    Metric("parwatch_collector_overhead_ratio", "gauge", ("rank",)),
    Metric("parwatch_collector_dropped_summaries_total", "counter", ("rank",)),
)


def rule_threshold(rule: str, key: str, rules_path: Path = DEFAULT_RULES) -> float:
    """A threshold (`above`/`below`) of one default guardrail, e.g. rule_threshold('stage-skew', 'above')."""
    doc = yaml.safe_load(Path(rules_path).read_text())
    for r in doc["rules"]:
        if r["name"] == rule:
            return float(r[key])
    raise KeyError(f"rule {rule!r} with {key!r} not found in {rules_path}; the dashboard draws its threshold")


# --- panel builders ------------------------------------------------------------------------------


def _targets(exprs) -> list[dict]:
    """[(expr, legend), ...] -> Prometheus targets A, B, ... that all use the datasource variable."""
    return [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}
        for i, (expr, legend) in enumerate(exprs)
    ]


def _thresholds(limit: float | None, good_below: bool = True) -> dict:
    low, high = ("green", "red") if good_below else ("red", "green")
    steps = [{"color": low, "value": None}]
    if limit is not None:
        steps.append({"color": high, "value": limit})
    return {"mode": "absolute", "steps": steps}


def timeseries(title, exprs, unit="none", desc="", w=12, h=8, limit=None, good_below=True, overrides=()):
    custom = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": True}
    if limit is not None:
        custom["thresholdsStyle"] = {"mode": "line"}
    return {
        "type": "timeseries", "title": title, "description": desc, "w": w, "h": h,
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": custom, "thresholds": _thresholds(limit, good_below)},
            "overrides": list(overrides),
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": _targets(exprs),
    }


def stat(title, exprs, unit="none", desc="", w=4, h=4, mappings=(), limit=None, decimals=None, text_mode="auto"):
    defaults = {"unit": unit, "mappings": list(mappings), "thresholds": _thresholds(limit)}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": desc, "w": w, "h": h,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                    "orientation": "auto", "textMode": text_mode},
        "targets": _targets(exprs),
    }


def bargauge(title, exprs, unit="none", desc="", w=12, h=8, limit=None):
    return {
        "type": "bargauge", "title": title, "description": desc, "w": w, "h": h,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "thresholds": _thresholds(limit)}, "overrides": []},
        "options": {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": _targets(exprs),
    }


def heatmap(title, expr, unit="s", desc="", w=12, h=8):
    panel = {
        "type": "heatmap", "title": title, "description": desc, "w": w, "h": h,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": unit},
                    "rowsFrame": {"layout": "auto"},
                    "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5,
                              "steps": 64, "fill": "dark-orange", "reverse": False},
                    "tooltip": {"mode": "single", "yHistogram": True}, "legend": {"show": True}},
        "targets": _targets([(expr, "{{le}}")]),
    }
    panel["targets"][0].update(format="heatmap")
    return panel


def _right_axis(name_regex: str) -> dict:
    return {"matcher": {"id": "byRegexp", "options": name_regex},
            "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": "none"}]}


def _dashed(name_regex: str) -> dict:
    return {"matcher": {"id": "byRegexp", "options": name_regex},
            "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}


def _value_map(*pairs) -> dict:
    """A value mapping: (value, text, colour), ... -> Grafana's {"type": "value"} mapping."""
    return {"type": "value", "options": {str(v): {"text": t, "color": c, "index": i} for i, (v, t, c) in enumerate(pairs)}}


def _layout(panels: list[dict]) -> list[dict]:
    """Number panels and place them left to right, wrapping at the grid's width."""
    x = y = row_h = 0
    for pid, p in enumerate(panels, start=1):
        w, h = p.pop("w"), p.pop("h")
        if x + w > GRID_WIDTH:
            x, y, row_h = 0, y + row_h, 0
        p.update(id=pid, datasource=DATASOURCE, gridPos={"h": h, "w": w, "x": x, "y": y})
        x, row_h = x + w, max(row_h, h)
    return panels


# --- the dashboard ---------------------------------------------------------------------------------

RI = "$__rate_interval"  # Grafana substitutes these; tests put concrete durations in their place.
RANGE = "$__range"
PRICE = "$price_per_gpu_hour"
IDLE, COMPUTE = "parwatch_stage_idle_seconds_total", "parwatch_stage_compute_seconds_total"


def _collective_quantile(q: float) -> str:
    return f"histogram_quantile({q}, sum by (le, op, group) (rate(parwatch_collective_duration_seconds_bucket[{RI}])))"


def _step_quantile(q: float) -> str:
    return f"histogram_quantile({q}, sum by (le, stage) (rate(parwatch_step_duration_seconds_bucket[{RI}])))"


def panels(rules_path: Path = DEFAULT_RULES) -> list[dict]:
    """Every panel, in reading order, before layout."""
    excess = rule_threshold("bubble-excess", "above", rules_path)
    skew = rule_threshold("stage-skew", "above", rules_path)
    util = rule_threshold("gpu-underutilized", "below", rules_path)
    info = "parwatch_run_info"
    run_labels = "run_id, schedule, tp, pp, dp, microbatches, version"
    return [
        # Run at a glance.
        stat("Step", [("max(parwatch_train_step)", "step")]),
        stat("Loss", [("max(parwatch_loss)", "loss")], decimals=4),
        stat("Tokens / s", [(f"max(rate(parwatch_tokens_total[{RI}]))", "tokens/s")], unit="short",
             desc="max, not sum: every sidecar exports the whole run's token count"),
        stat("Ranks up", [("sum(parwatch_rank_up)", "up"), ("count(parwatch_rank_up)", "ranks")]),
        stat("Run", [("max(parwatch_run_paused)", "paused")],
             mappings=[_value_map((0, "running", "green"), (1, "paused", "red"))]),
        stat("Last good checkpoint", [("max(parwatch_checkpoint_last_good_step)", "step")]),
        stat("Run info", [(f"max by ({run_labels}) ({info})",
                           "{{run_id}}  {{schedule}}  tp={{tp}} pp={{pp}} dp={{dp}} m={{microbatches}}  v{{version}}")],
             w=24, h=3, text_mode="name"),
        # Training progress.
        timeseries("Loss and step", [("max(parwatch_loss)", "loss"), ("max(parwatch_train_step)", "step")],
                   overrides=[_right_axis("step")]),
        timeseries("Tokens per second", [(f"max(rate(parwatch_tokens_total[{RI}]))", "tokens/s")], unit="short"),
        timeseries("Step duration per stage (p50, p99)",
                   [(_step_quantile(0.5), "stage {{stage}} p50"), (_step_quantile(0.99), "stage {{stage}} p99")], unit="s"),
        timeseries("Model FLOPs utilisation", [("max by (rank) (parwatch_model_flops_utilization_ratio)", "rank {{rank}}")],
                   unit="percentunit"),
        # Pipeline bubble.
        timeseries("Bubble ratio per stage vs theoretical",
                   [("max by (stage) (parwatch_stage_bubble_ratio)", "stage {{stage}}"),
                    ("max by (stage) (parwatch_stage_bubble_theoretical_ratio)", "stage {{stage}} theoretical")],
                   unit="percentunit", overrides=[_dashed("theoretical")],
                   desc="measured idle / (step - other) against the schedule's (p-1)/(v*m+p-1)"),
        timeseries("Bubble excess (measured - theoretical)",
                   [("max by (stage) (parwatch_stage_bubble_ratio) - on (stage) "
                     "max by (stage) (parwatch_stage_bubble_theoretical_ratio)", "stage {{stage}}")],
                   unit="percentunit", limit=excess, desc="the part a user can fix; the line is the bubble-excess guardrail"),
        timeseries("Pipeline skew", [("max(parwatch_pipeline_skew_ratio)", "skew")], limit=skew,
                   desc="max over stages of compute seconds / mean; the line is the stage-skew guardrail"),
        timeseries("Stage compute vs idle (seconds per second)",
                   [(f"sum by (stage) (rate({COMPUTE}[{RI}]))", "stage {{stage}} compute"),
                    (f"sum by (stage) (rate({IDLE}[{RI}]))", "stage {{stage}} idle")],
                   desc="summed over the stage's ranks: 1 means one rank busy (or idle) all the time"),
        # Cost of idling.
        stat("Idle GPU-hours (time range)", [(f"sum(increase({IDLE}[{RANGE}])) / 3600", "GPU-hours")], w=6, decimals=2),
        stat("Idle cost (time range)", [(f"sum(increase({IDLE}[{RANGE}])) / 3600 * {PRICE}", "cost")], w=6, decimals=2,
             desc="idle GPU-hours x the price-per-GPU-hour variable"),
        stat("GPUs idle on average", [(f"sum(rate({IDLE}[{RANGE}]))", "GPUs")], w=6, decimals=2),
        stat("Idle share of compute + idle", [(f"sum(increase({IDLE}[{RANGE}])) / (sum(increase({IDLE}[{RANGE}])) + "
                                               f"sum(increase({COMPUTE}[{RANGE}])))", "idle")],
             unit="percentunit", w=6),
        timeseries("Idle cost rate (per hour)", [(f"sum(rate({IDLE}[{RI}])) * {PRICE}", "cost / hour")], w=24, h=6,
                   desc="GPUs idle right now x the price per GPU-hour"),
        # Collectives.
        heatmap("Collective latency", f"sum by (le) (rate(parwatch_collective_duration_seconds_bucket[{RI}]))"),
        timeseries("Collective p99 per op and group", [(_collective_quantile(0.99), "{{op}} {{group}}")], unit="s"),
        timeseries("Bus bandwidth per op and group",
                   [("max by (op, group) (parwatch_collective_busbw_bytes_per_second)", "{{op}} {{group}}")], unit="Bps"),
        timeseries("Collective bytes per second",
                   [(f"sum by (op, group) (rate(parwatch_collective_bytes_total[{RI}]))", "{{op}} {{group}}")], unit="Bps"),
        # GPUs.
        timeseries("GPU utilisation", [("max by (rank, gpu) (parwatch_gpu_utilization_ratio)", "rank {{rank}} gpu {{gpu}}")],
                   unit="percentunit", limit=util, good_below=False,
                   desc="the line is the gpu-underutilized guardrail"),
        timeseries("GPU power", [("max by (rank, gpu) (parwatch_gpu_power_watts)", "rank {{rank}} gpu {{gpu}}")], unit="watt"),
        timeseries("GPU memory used", [("max by (rank, gpu) (parwatch_gpu_memory_used_bytes)", "rank {{rank}} gpu {{gpu}}")],
                   unit="bytes"),
        timeseries("Torch peak allocated memory",
                   [("max by (rank, stage) (parwatch_torch_memory_max_allocated_bytes)", "rank {{rank}} stage {{stage}}")],
                   unit="bytes", desc="per step; GPipe holds m microbatches' activations, 1F1B at most p-s"),
        timeseries("GPU temperature", [("max by (rank, gpu) (parwatch_gpu_temperature_celsius)", "rank {{rank}} gpu {{gpu}}")],
                   unit="celsius"),
        timeseries("GPU SM clock", [("max by (rank, gpu) (parwatch_gpu_sm_clock_hertz)", "rank {{rank}} gpu {{gpu}}")],
                   unit="hertz"),
        # Guardrails and the collector's own health.
        stat("Guardrail state", [("max by (rule) (parwatch_guardrail_state)", "{{rule}}")], w=12, h=6, limit=2,
             mappings=[_value_map((0, "ok", "green"), (1, "pending", "orange"), (2, "firing", "red"))]),
        bargauge("Guardrail actions (time range)",
                 [(f"sum by (rule, action) (increase(parwatch_guardrail_actions_total[{RANGE}]))", "{{rule}} {{action}}")],
                 h=6),
        timeseries("Ranks up", [("min by (rank) (parwatch_rank_up)", "rank {{rank}}")], w=8),
        timeseries("NVML up", [("min by (rank) (parwatch_nvml_up)", "rank {{rank}}")], w=8),
        timeseries("Collector overhead", [("max by (rank) (parwatch_collector_overhead_ratio)", "rank {{rank}}")],
                   unit="percentunit", w=8, desc="share of the step the collector spent on the training thread"),
        timeseries("Dropped summaries per second",
                   [(f"sum by (rank) (rate(parwatch_collector_dropped_summaries_total[{RI}]))", "rank {{rank}}")], w=24, h=6,
                   desc="non-zero while a sidecar is away: the collector drops instead of blocking training"),
    ]


def build_dashboard(price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR, rules_path: Path = DEFAULT_RULES) -> dict:
    """The dashboard model (Grafana schemaVersion 39), ready for file provisioning or the HTTP API."""
    price = f"{price_per_gpu_hour:g}"
    return {
        "id": None,
        "uid": DASHBOARD_UID,
        "title": "parwatch: TP+PP training",
        "description": "Pipeline bubble, collective latency, GPU health, idle cost and guardrails of a parwatch run",
        "tags": ["parwatch", "training"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            {"type": "textbox", "name": "price_per_gpu_hour", "label": "Price per GPU-hour", "query": price,
             "current": {"text": price, "value": price}, "hide": 0, "options": [{"selected": True, "text": price, "value": price}],
             "description": "what one accelerator costs per hour; the idle-cost panels multiply by it"},
        ]},
        "panels": _layout(panels(rules_path)),
    }


def dashboard_json(dashboard: dict | None = None) -> str:
    """The dashboard as the text of dashboards/parwatch.json (stable key order, trailing newline)."""
    return json.dumps(build_dashboard() if dashboard is None else dashboard, indent=2) + "\n"


def export_dashboard(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dashboard_json())
    return path


# --- Grafana HTTP API ------------------------------------------------------------------------------


def connect(url: str, token: str | None):
    """A grafana-client GrafanaApi for URL; token None uses credentials in the URL (user:pass@host)."""
    from grafana_client import GrafanaApi

    return GrafanaApi.from_url(url, credential=token)


def ensure_folder(api, uid: str, title: str) -> None:
    """Create the folder unless it exists (looked up by uid)."""
    from grafana_client.client import GrafanaClientError

    try:
        api.folder.get_folder(uid)
    except GrafanaClientError as err:
        if err.status_code != 404:
            raise
        api.folder.create_folder(title, uid=uid)


def push_dashboard(api, dashboard: dict | None = None, folder_uid: str = DEFAULT_FOLDER_UID,
                   folder_title: str = "parwatch") -> dict:
    """Create or overwrite the dashboard in FOLDER_UID through api (a GrafanaApi); returns Grafana's answer."""
    ensure_folder(api, folder_uid, folder_title)
    body = dict(build_dashboard() if dashboard is None else dashboard, id=None)
    return api.dashboard.update_dashboard({"dashboard": body, "folderUid": folder_uid, "overwrite": True,
                                           "message": "parwatch dashboards push"})
