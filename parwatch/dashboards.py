"""The Grafana dashboard: built in code, exported to dashboards/parwatch.json, pushed with grafana-client.

The panels are data (title, kind, PromQL, unit, size) and a flow layout places them, so adding a
panel is one line. Every query reads recorded series (parwatch/recording.py, over the catalogue
of parwatch/catalog.py), so a panel costs the same at 16 ranks as at 16,384; a unit test holds
every query to that. Thresholds drawn on panels are read from the packaged default guardrails, so
a line on the dashboard and the rule that acts on it never disagree.

Built by hand rather than with grafana-foundation-sdk (tried: docs/deploy.md, "Dashboards as
code"): four small panel builders carry what the SDK would, without a dependency whose releases
are numbered per Grafana version.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from parwatch import recording as rec
from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR
from parwatch.vocabulary import Comparison

DASHBOARD_UID = "parwatch"
DEFAULT_FOLDER_UID = "parwatch"
DEFAULT_RULES = Path(__file__).parent / "sidecar" / "default_rules.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RECORDED_NAME = re.compile(r"\b[a-z_]+:parwatch_[a-z0-9_]+:[a-z0-9_]+(\{[^}]*\})?")
RUN_FILTER = f'{{{rec.RUN_LABEL}=~"$job"}}'
"""Recorded series keep the scrape job (one per run); the job variable picks the run."""
RUN_VARIABLE_QUERY = f"label_values({rec.job('parwatch_train_step', 'max')}, {rec.RUN_LABEL})"
GRID_WIDTH = 24


def rule_threshold(rule: str, key: Comparison, rules_path: Path = DEFAULT_RULES) -> float:
    """A threshold (`above`/`below`) of one default guardrail, e.g. rule_threshold('stage-skew', 'above')."""
    doc = yaml.safe_load(Path(rules_path).read_text())
    for r in doc["rules"]:
        if r["name"] == rule:
            return float(r[key])
    raise KeyError(f"rule {rule!r} with {key!r} not found in {rules_path}; the dashboard draws its threshold")


# --- panel builders ------------------------------------------------------------------------------


def for_run(expr: str) -> str:
    """Every recorded series in expr restricted to the run chosen in the dashboard's job variable."""
    return RECORDED_NAME.sub(_with_run_filter, expr)


def _with_run_filter(match: re.Match) -> str:
    """name -> name{job=~"$job"}; name{a="b"} -> name{job=~"$job",a="b"}."""
    selector = match.group(1)
    if not selector:
        return match.group(0) + RUN_FILTER
    return match.group(0)[: -len(selector)] + RUN_FILTER[:-1] + "," + selector[1:]


def _targets(exprs) -> list[dict]:
    """[(expr, legend), ...] -> Prometheus targets A, B, ... that all use the datasource variable."""
    return [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": for_run(expr),
            "legendFormat": legend,
            "range": True,
        }
        for i, (expr, legend) in enumerate(exprs)
    ]


def _thresholds(limit: float | None, good_below: bool = True) -> dict:
    low, high = ("green", "red") if good_below else ("red", "green")
    steps: list[dict[str, object]] = [{"color": low, "value": None}]
    if limit is not None:
        steps.append({"color": high, "value": limit})
    return {"mode": "absolute", "steps": steps}


def timeseries(title, exprs, unit="none", desc="", w=12, h=8, limit=None, good_below=True, overrides=()):
    custom = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": True}
    if limit is not None:
        custom["thresholdsStyle"] = {"mode": "line"}
    return {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "w": w,
        "h": h,
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": custom, "thresholds": _thresholds(limit, good_below)},
            "overrides": list(overrides),
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _targets(exprs),
    }


def stat(title, exprs, unit="none", desc="", w=4, h=4, mappings=(), limit=None, decimals=None, text_mode="auto"):
    defaults = {"unit": unit, "mappings": list(mappings), "thresholds": _thresholds(limit)}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "w": w,
        "h": h,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
        },
        "targets": _targets(exprs),
    }


def bargauge(title, exprs, unit="none", desc="", w=12, h=8, limit=None):
    return {
        "type": "bargauge",
        "title": title,
        "description": desc,
        "w": w,
        "h": h,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "thresholds": _thresholds(limit)}, "overrides": []},
        "options": {
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        },
        "targets": _targets(exprs),
    }


def heatmap(title, expr, unit="s", desc="", w=12, h=8):
    panel = {
        "type": "heatmap",
        "title": title,
        "description": desc,
        "w": w,
        "h": h,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "yAxis": {"axisPlacement": "left", "unit": unit},
            "rowsFrame": {"layout": "auto"},
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "scale": "exponential",
                "exponent": 0.5,
                "steps": 64,
                "fill": "dark-orange",
                "reverse": False,
            },
            "tooltip": {"mode": "single", "yHistogram": True},
            "legend": {"show": True},
        },
        "targets": _targets([(expr, "{{le}}")]),
    }
    panel["targets"][0].update(format="heatmap")
    return panel


def _right_axis(name_regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": name_regex},
        "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": "none"}],
    }


def _stacked(panel: dict) -> dict:
    panel["fieldConfig"]["defaults"]["custom"].update(stacking={"mode": "normal", "group": "A"}, fillOpacity=60)
    return panel


def _unstacked(name_regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": name_regex},
        "properties": [{"id": "custom.stacking", "value": {"mode": "none"}}, {"id": "custom.fillOpacity", "value": 0}],
    }


def _dashed(name_regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": name_regex},
        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
    }


def _value_map(*pairs) -> dict:
    """A value mapping: (value, text, colour), ... -> Grafana's {"type": "value"} mapping."""
    return {
        "type": "value",
        "options": {str(v): {"text": t, "color": c, "index": i} for i, (v, t, c) in enumerate(pairs)},
    }


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

RANGE = "$__range"  # Grafana substitutes these; tests put concrete values in their place.
RANGE_S = "$__range_s"
PRICE = "$price_per_gpu_hour"
OG_LEGEND = "{{op}} {{group}}"


def _avg_range(series: str) -> str:
    """The mean of a recorded rate over the dashboard's time range."""
    return f"avg_over_time({series}[{RANGE}])"


def _job_ops(name: str, ops, unit_legend: str = "") -> list[tuple[str, str]]:
    return [(rec.job(name, op), f"{op}{unit_legend}") for op in ops]


def panels(rules_path: Path = DEFAULT_RULES, window: str = rec.RATE_WINDOW) -> list[dict]:
    """Every panel, in reading order, before layout; recorded rates over `window` (as recorded)."""
    excess = rule_threshold("bubble-excess", Comparison.ABOVE, rules_path)
    skew = rule_threshold("stage-skew", Comparison.ABOVE, rules_path)
    util = rule_threshold("gpu-underutilized", Comparison.BELOW, rules_path)
    suspect = rule_threshold("suspect-device", Comparison.ABOVE, rules_path)
    step_buckets = rec.bucket_rate_name("stage", "parwatch_step_duration_seconds", window)
    coll_buckets = rec.bucket_rate_name("op_group", "parwatch_collective_duration_seconds", window)
    transfer_buckets = rec.bucket_rate_name("op_group", "parwatch_collective_transfer_seconds", window)

    def rate(level, counter):
        return rec.rate_name(level, counter, window)

    idle, compute = (
        rate("job", "parwatch_stage_idle_seconds_total"),
        rate("job", "parwatch_stage_compute_seconds_total"),
    )
    return [
        # Run at a glance.
        stat("Step", [(rec.job("parwatch_train_step", "max"), "step")]),
        stat(
            "Loss",
            [(rec.job("parwatch_loss", "max"), "loss"), (rec.job("parwatch_loss_nonfinite", "max"), "non-finite")],
            decimals=4,
            desc="non-finite is 1 while the newest loss is NaN or infinite (a store may drop NaN samples)",
        ),
        stat(
            "Tokens / s",
            [(rate("job", "parwatch_tokens_total"), "tokens/s")],
            unit="short",
            desc="max over sidecars, not sum: every sidecar exports the whole run's token count",
        ),
        stat("Ranks up", [(rec.job("parwatch_rank_up", "sum"), "up"), (rec.job("parwatch_rank_up", "count"), "ranks")]),
        stat(
            "Run",
            [(rec.job("parwatch_run_paused", "max"), "paused")],
            mappings=[_value_map((0, "running", "green"), (1, "paused", "red"))],
        ),
        stat("Last good checkpoint", [(rec.job("parwatch_checkpoint_last_good_step", "max"), "step")]),
        stat(
            "Run info",
            [
                (
                    rec.RUN_INFO,
                    "{{run_id}}  {{schedule}}  tp={{tp}} pp={{pp}} dp={{dp}} ({{order}}) m={{microbatches}}  v{{version}}",
                )
            ],
            w=12,
            h=4,
            text_mode="name",
        ),
        stat(
            "Hang",
            [
                (rec.job("parwatch_hang_detected", "max"), "hang"),
                (rec.job("parwatch_rank_state_hung", "count"), "ranks hung"),
                (rec.job("parwatch_rank_state_gone", "count"), "ranks gone"),
            ],
            w=12,
            h=4,
            limit=1,
            desc="a hang is named when a rank is stuck while the others wait on it",
        ),
        # Training progress.
        timeseries(
            "Loss and step",
            [(rec.job("parwatch_loss", "max"), "loss"), (rec.job("parwatch_train_step", "max"), "step")],
            overrides=[_right_axis("step")],
        ),
        timeseries("Tokens per second", [(rate("job", "parwatch_tokens_total"), "tokens/s")], unit="short"),
        timeseries(
            "Step duration per stage (p50, p99)",
            [
                (f"histogram_quantile(0.5, {step_buckets})", "stage {{stage}} p50"),
                (f"histogram_quantile(0.99, {step_buckets})", "stage {{stage}} p99"),
                (rec.JOB_STEP_P99, f"run p99 ({rec.QUANTILE_WINDOW})"),
            ],
            unit="s",
        ),
        timeseries(
            "Model FLOPs utilisation",
            _job_ops("parwatch_model_flops_utilization_ratio", ("min", "avg"), " over ranks"),
            unit="percentunit",
        ),
        # Pipeline bubble: one bubble per stage (parwatch.bubble), as the guardrails judge it.
        timeseries(
            "Bubble ratio per stage vs theoretical",
            [(rec.stage_bubble(window), "stage {{stage}}"), (rec.STAGE_BUBBLE_THEORY, "stage {{stage}} theoretical")],
            unit="percentunit",
            overrides=[_dashed("theoretical")],
            desc="idle / (idle + compute), summed over the stage's ranks, against the schedule's (p-1)/(v*m+p-1)",
        ),
        timeseries(
            "Bubble excess (measured - theoretical)",
            [(rec.stage_bubble_excess(window), "stage {{stage}}")],
            unit="percentunit",
            limit=excess,
            desc="the part a user can fix; the line is the bubble-excess guardrail, which judges this same series",
        ),
        timeseries(
            "Bubble by cause per stage",
            [(series, f"stage {{{{stage}}}} {cause}") for cause, series in rec.STAGE_BUBBLE_CAUSES.items()],
            unit="percentunit",
            desc="schedule: the formula or simulation at uniform stage times; imbalance: this step's stage "
            "times simulated, minus schedule; wait: measured minus simulated (p2p, collectives, host)",
        ),
        _stacked(
            timeseries(
                "Where the time went (goodput ledger)",
                [
                    (f'{rate("category", "parwatch_time_seconds_total")}{{category!="wasted"}}', "{{category}}"),
                    (f'{rate("category", "parwatch_time_seconds_total")}{{category="wasted"}}', "of which wasted"),
                ],
                unit="short",
                overrides=[_unstacked("of which wasted")],
                desc="seconds per second over all ranks, by category; stacked they are the ranks' wall time. "
                "productive counts every step as it ran; 'of which wasted' is the part rollbacks discarded "
                "(docs/goodput.md)",
            )
        ),
        timeseries(
            "Step time: ideal and deviation (ml-goodput-measurement)",
            [
                (rec.job("parwatch_ideal_step_seconds", "max"), "ideal step time"),
                (rec.job("parwatch_step_time_deviation_seconds", "max"), "step-time deviation"),
            ],
            unit="s",
            desc="Google's formulas (parwatch.goodput): the ideal is the mean of the steps of 1 s or more "
            "without outliers; the deviation is the p90 of the last 100 steps' distance from it",
        ),
        stat(
            "Goodput / ETTR",
            [(rec.goodput(window), "goodput"), (rec.ettr(window), "ETTR")],
            unit="percentunit",
            desc="goodput: net productive / wall time; ETTR: the share of wall time in training steps that count",
        ),
        timeseries(
            "Pipeline skew",
            [(rec.job("parwatch_pipeline_skew_ratio", "max"), "skew")],
            limit=skew,
            desc="max over stages of compute seconds / mean; the line is the stage-skew guardrail",
        ),
        timeseries(
            "Stage compute vs idle (seconds per second)",
            [
                (rate("stage", "parwatch_stage_compute_seconds_total"), "stage {{stage}} compute"),
                (rate("stage", "parwatch_stage_idle_seconds_total"), "stage {{stage}} idle"),
            ],
            desc="summed over the stage's ranks: 1 means one rank busy (or idle) all the time",
        ),
        # Cost of idling.
        stat("Idle GPU-hours (time range)", [(f"{_avg_range(idle)} * {RANGE_S} / 3600", "GPU-hours")], w=6, decimals=2),
        stat(
            "Idle cost (time range)",
            [(f"{_avg_range(idle)} * {RANGE_S} / 3600 * {PRICE}", "cost")],
            w=6,
            decimals=2,
            desc="idle GPU-hours x the price-per-GPU-hour variable",
        ),
        stat("GPUs idle on average", [(_avg_range(idle), "GPUs")], w=6, decimals=2),
        stat(
            "Idle share of compute + idle",
            [(f"{_avg_range(idle)} / ({_avg_range(idle)} + {_avg_range(compute)})", "idle")],
            unit="percentunit",
            w=6,
        ),
        timeseries(
            "Idle cost rate (per hour)",
            [(f"{idle} * {PRICE}", "cost / hour")],
            w=24,
            h=6,
            desc="GPUs idle right now x the price per GPU-hour",
        ),
        # Collectives.
        heatmap("Collective latency", f"sum by (le) ({coll_buckets})"),
        timeseries(
            "Collective p99 per op and group", [(f"histogram_quantile(0.99, {coll_buckets})", OG_LEGEND)], unit="s"
        ),
        timeseries(
            "Collective transfer p99 (arrival wait removed)",
            [(f"histogram_quantile(0.99, {transfer_buckets})", OG_LEGEND)],
            unit="s",
            desc="what the link costs once the last rank has arrived; the rest is waiting on a straggler",
        ),
        timeseries(
            "Collective wait (seconds per second)",
            [(rate("op_group", "parwatch_collective_wait_seconds_total"), OG_LEGEND)],
            unit="s",
            desc="time ranks spent in collectives waiting for the last rank to arrive",
        ),
        timeseries(
            "Bus bandwidth per op and group",
            [("op_group:parwatch_collective_busbw_bytes_per_second:avg", OG_LEGEND)],
            unit="Bps",
        ),
        timeseries(
            "Collective bytes per second",
            [(rate("op_group", "parwatch_collective_bytes_total"), OG_LEGEND)],
            unit="Bps",
        ),
        # Stragglers and hangs.
        timeseries(
            f"Straggler effect (top {rec.TOP_K} ranks, seconds waited for later arrivals per second)",
            [
                (rec.stragglers_top(window), "rank {{rank}}"),
                (rate("job", "parwatch_rank_straggler_seconds_total"), "all ranks"),
            ],
            unit="s",
            desc="DeepSpeed's straggler effect: each rank's collective time beyond the instance's shortest; "
            "the rank the others wait for has the least",
        ),
        timeseries(
            "Stragglers by cause (share of the step)",
            [(rec.STRAGGLER_CAUSES, "{{cause}}")],
            unit="percentunit",
            desc="straggler attribution: slow data, host contention, slow compute, "
            "slow link; the decision's evidence names the rank, stage, host or link",
        ),
        timeseries(
            "Collective instances not split (per second)",
            [(rate("op_group_reason", "parwatch_collective_unmatched_total"), "{{op}} {{group}} {{reason}}")],
            desc="remote: a member's record never reached the sidecar that matches it (the leader matches "
            "cross-node instances; a node without --leader-url cannot); incomplete: a record was lost; "
            "unsent: a node could not forward it to the leader",
        ),
        timeseries(
            "Ranks not running (1 hung, 2 gone)",
            [(rec.RANKS_NOT_RUNNING, "rank {{rank}}")],
            desc="only ranks that are not running have a series here",
        ),
        timeseries(
            "Transient faults per rank (suspect devices)",
            [(rec.SUSPECT_RANKS, "rank {{rank}}")],
            limit=suspect,
            desc="steps whose NaN/inf or loss spike the rank produced and the re-run on the same microbatches "
            "did not reproduce (the check before the optimizer step); above the line the suspect-device "
            "guardrail names the rank. Only ranks with one have a series",
        ),
        # GPUs.
        timeseries(
            "GPU utilisation",
            [
                *_job_ops("parwatch_gpu_utilization_ratio", rec.GUARDRAIL_REDUCES, " over GPUs"),
                (rec.GPU_UTIL_BOTTOM, "rank {{rank}} gpu {{gpu}}"),
            ],
            unit="percentunit",
            limit=util,
            good_below=False,
            desc=f"run min / avg / max and the {rec.TOP_K} least used GPUs; the line is the gpu-underutilized guardrail",
        ),
        timeseries("GPU power", _job_ops("parwatch_gpu_power_watts", ("sum", "max")), unit="watt"),
        timeseries("GPU memory used", _job_ops("parwatch_gpu_memory_used_bytes", ("max",)), unit="bytes"),
        timeseries(
            "Torch peak allocated memory",
            [(rec.STAGE_MEMORY, "stage {{stage}}")],
            unit="bytes",
            desc="max over the stage's ranks, per step; GPipe holds m microbatches' activations, 1F1B at most p-s",
        ),
        timeseries("GPU temperature", _job_ops("parwatch_gpu_temperature_celsius", ("max",)), unit="celsius"),
        timeseries("GPU SM clock", _job_ops("parwatch_gpu_sm_clock_hertz", ("min",)), unit="hertz"),
        # Guardrails and parwatch's own health.
        stat(
            "Guardrail state",
            [("rule:parwatch_guardrail_state:max", "{{rule}}")],
            w=12,
            h=6,
            limit=2,
            mappings=[_value_map((0, "ok", "green"), (1, "pending", "orange"), (2, "firing", "red"))],
        ),
        bargauge(
            "Guardrail actions (time range)",
            [(f"increase(rule_action:parwatch_guardrail_actions:max[{RANGE}])", "{{rule}} {{action}}")],
            h=6,
        ),
        timeseries(
            "Ranks up",
            [*_job_ops("parwatch_rank_up", ("min", "sum")), (rec.RANKS_DOWN, "rank {{rank}} down")],
            w=8,
            desc="min and sum over ranks, and a series for each rank that stopped reporting",
        ),
        timeseries("NVML up", _job_ops("parwatch_nvml_up", ("min", "sum")), w=8),
        timeseries(
            "Collector overhead",
            _job_ops("parwatch_collector_overhead_ratio", ("max", "avg"), " over ranks"),
            unit="percentunit",
            w=8,
            desc="share of the step the collector spent on the training thread",
        ),
        timeseries(
            "parwatch's own cost (share of the step)",
            [
                (rec.self_share("max", window), "{{part}} max over ranks"),
                (rec.self_share("avg", window), "{{part}} avg over ranks"),
            ],
            unit="percentunit",
            w=8,
            desc="each rank's time in parwatch's span hooks and collector (training thread) and in its shipper "
            "and activity threads (CPU), per second of the run: the share of the step it costs",
        ),
        timeseries(
            "Experiment tracker points per second",
            [
                (rec.rate_name("tracker", "parwatch_tracker_points_written_total", window), "{{tracker}} written"),
                (rec.rate_name("tracker", "parwatch_tracker_points_dropped_total", window), "{{tracker}} dropped"),
            ],
            w=8,
            h=6,
            desc="what the leader wrote to TensorBoard, MLflow or W&B (--export); dropped: the tracker was slower "
            "than the run, or failed (the sidecar's log names why)",
        ),
        timeseries(
            "Dropped summaries per second",
            [(rate("job", "parwatch_collector_dropped_summaries_total"), "all ranks")],
            w=8,
            h=6,
            desc="non-zero while a sidecar is away: the collector drops instead of blocking training",
        ),
        stat(
            "Rules reloads refused",
            [(rec.job("parwatch_sidecar_rules_reload_failures", "sum"), "refused")],
            w=8,
            h=6,
            limit=1,
            desc="SIGHUP reloads refused because the new rules file was invalid (the old rules stay)",
        ),
        stat(
            "Leader unreachable since",
            [(rec.job("parwatch_leader_unreachable_since_timestamp_seconds", "max") + " * 1000", "since")],
            unit="dateTimeAsIso",
            w=8,
            h=6,
            mappings=[_value_map((0, "reachable", "green"))],
            desc="a node sidecar whose digests fail or are refused, or that has no --leader-url in a larger run: "
            "its ranks are judged by nobody",
        ),
        timeseries(
            "Posts refused per second",
            [(rate("post_reason", "parwatch_posts_refused_total"), "{{post}} {{reason}}")],
            w=16,
            h=6,
            desc="ranks' summaries and activity, and node digests at the leader, refused (unauthorized: a "
            "wrong or missing token)",
        ),
    ]


def build_dashboard(
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
    rules_path: Path = DEFAULT_RULES,
    rate_window: str = rec.RATE_WINDOW,
) -> dict:
    """The dashboard model (Grafana schemaVersion 39), ready for file provisioning or the HTTP API.
    rate_window must be the one the recording rules were rendered with."""
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
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Prometheus",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                },
                {
                    "type": "query",
                    "name": "job",
                    "label": "Run (scrape job)",
                    "datasource": DATASOURCE,
                    "query": RUN_VARIABLE_QUERY,
                    "definition": RUN_VARIABLE_QUERY,
                    "refresh": 2,
                    "sort": 1,
                    "includeAll": False,
                    "multi": False,
                    "current": {},
                    "hide": 0,
                    "regex": "",
                    "options": [],
                    "description": "one Helm release (one run) per job; every panel reads this run's recorded series",
                },
                {
                    "type": "textbox",
                    "name": "price_per_gpu_hour",
                    "label": "Price per GPU-hour",
                    "query": price,
                    "current": {"text": price, "value": price},
                    "hide": 0,
                    "options": [{"selected": True, "text": price, "value": price}],
                    "description": "what one accelerator costs per hour; the idle-cost panels multiply by it",
                },
            ]
        },
        "panels": _layout(panels(rules_path, rate_window)),
    }


def dashboard_json(dashboard: dict | None = None) -> str:
    """The dashboard as the text of dashboards/parwatch.json (stable key order, trailing newline)."""
    return json.dumps(build_dashboard() if dashboard is None else dashboard, indent=2) + "\n"


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


def push_dashboard(
    api, dashboard: dict | None = None, folder_uid: str = DEFAULT_FOLDER_UID, folder_title: str = "parwatch"
) -> dict:
    """Create or overwrite the dashboard in FOLDER_UID through api (a GrafanaApi); returns Grafana's answer."""
    ensure_folder(api, folder_uid, folder_title)
    body = dict(build_dashboard() if dashboard is None else dashboard, id=None)
    return api.dashboard.update_dashboard(
        {"dashboard": body, "folderUid": folder_uid, "overwrite": True, "message": "parwatch dashboards push"}
    )
