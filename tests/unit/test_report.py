"""parwatch report: trace invariants, timeline picture, plots and summary from a synthetic run dir."""

from __future__ import annotations

import json
import math
import random
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import msgspec
import pytest
from click.testing import CliRunner
from PIL import Image

from parwatch.report.build import ReportOptions, StepNotSampled, build_report
from parwatch.report.loader import load_run
from parwatch.report.plots import loss_segments
from parwatch.report.stats import bubble_table, collective_series, cost_estimate, quantile_from_buckets
from parwatch.report.timeline import draw_timeline, lane_spans
from parwatch.report.trace import build_trace
from parwatch.wire.log import Decision, log_record
from parwatch.wire.steps import COLLECTIVE_BUCKETS
from tests.fixtures import synthetic as syn
from tests.fixtures.make_run_dir import make_run_dir

PP, M, TP, DP = 4, 8, 2, 2


@pytest.fixture(scope="module")
def run_1f1b(tmp_path_factory):
    """p=4, m=8, tp=2, dp=2 (16 ranks), a slow stage; the report built once for the module."""
    info = make_run_dir(
        tmp_path_factory.mktemp("run") / "run", pp=PP, microbatches=M, tp=TP, dp=DP, steps=6, slow_stage=2
    )
    return info, build_report(info.path)


@pytest.fixture(scope="module")
def trace_gpipe(tmp_path_factory):
    """GPipe with p=2: the first stage posts many sends that are in flight together."""
    info = make_run_dir(
        tmp_path_factory.mktemp("gpipe") / "run", pp=2, microbatches=12, schedule="gpipe", steps=2, sampled_steps=[2]
    )
    return build_trace(load_run(info.path))


def _x_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _assert_lanes_do_not_overlap(trace):
    lanes = {}
    for e in _x_events(trace):
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert lanes
    for key, spans in lanes.items():
        spans.sort()
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0 + 1e-6, f"lane {key}: [{a0}, {a1}] overlaps an event starting at {b0}"


def test_trace_events_have_the_fields_chrome_and_perfetto_need(run_1f1b):
    trace = json.loads(run_1f1b[1]["trace"].read_text())
    assert trace["displayTimeUnit"] == "ms"
    assert len(_x_events(trace)) > 100
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and e["name"]
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0


def test_trace_lanes_never_overlap(run_1f1b, trace_gpipe):
    _assert_lanes_do_not_overlap(json.loads(run_1f1b[1]["trace"].read_text()))
    _assert_lanes_do_not_overlap(trace_gpipe)
    # GPipe's in-flight sends overlap each other, so they must have been spread over extra threads.
    names = {e["args"]["name"] for e in trace_gpipe["traceEvents"] if e["name"] == "thread_name"}
    assert "p2p sends in flight #2" in names


def test_trace_lanes_never_overlap_for_arbitrary_spans(tmp_path):
    rng = random.Random(3)
    lines = []
    for i in range(300):
        a = rng.uniform(0, 1)
        kind = rng.choice(["forward", "backward", "send", "recv", "collective", "optimizer"])
        lines.append(
            {
                "run_id": "r",
                "rank": rng.randrange(2),
                "stage": 0,
                "step": 1 + i % 2,
                "kind": kind,
                "start_s": a,
                "end_s": a + rng.uniform(0, 0.2),
                "attrs": {"microbatch": i, "op": "all_reduce", "group": rng.choice(["tp", "dp"])},
            }
        )
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = build_trace(load_run(tmp_path))
    assert len(_x_events(trace)) == 300 + 4  # every span, plus one step slice per rank and step
    _assert_lanes_do_not_overlap(trace)


def test_trace_has_2m_compute_spans_per_stage_and_step(run_1f1b):
    info, written = run_1f1b
    trace = json.loads(written["trace"].read_text())
    for step in info.sampled_steps:
        for rank in range(info.world_size):
            n = sum(
                1
                for e in _x_events(trace)
                if e["pid"] == rank and e["args"]["step"] == step and e["cat"] in ("forward", "backward")
            )
            assert n == 2 * M, f"rank {rank} step {step}: {n} compute spans"


def test_trace_names_every_rank_with_its_stage(run_1f1b):
    info, written = run_1f1b
    meta = [e for e in json.loads(written["trace"].read_text())["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert sorted(names) == list(range(info.world_size))
    run = load_run(info.path)
    for rank, i in run.rank_info().items():
        assert f"rank {rank} · stage {i['stage']}" in names[rank]
    threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {"compute (forward/backward)", "tp collectives", "other (optimizer, DP sync, checkpoint)"} <= threads


def test_timeline_png_has_the_requested_size_and_colours(run_1f1b, tmp_path):
    with Image.open(run_1f1b[1]["timeline_png"]) as img:
        assert img.size[0] == 1600
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 24)) > 5
    run = load_run(run_1f1b[0].path)
    drawn = draw_timeline(run, 4, tmp_path / "t.png", None, width_px=1000, height_px=520)
    with Image.open(tmp_path / "t.png") as img:
        assert img.size == (1000, 520)
    assert drawn["stages"] == [0, 1, 2, 3]
    # The lanes are the tp_rank 0, dp_rank 0 ranks, and their bubble is that of the step's summary.
    for stage, rank in drawn["ranks"].items():
        s = next(s for s in run.summaries if s["rank"] == rank and s["step"] == 4)
        assert (s["stage"], s["tp_rank"], s["dp_rank"]) == (stage, 0, 0)
        assert drawn["bubble"][stage] == (s["bubble_ratio"], s["bubble_theoretical_ratio"])


def test_timeline_svg_is_xml(run_1f1b):
    root = ET.parse(run_1f1b[1]["timeline_svg"]).getroot()
    assert root.tag.endswith("svg")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.targets = set()

    def handle_starttag(self, tag, attrs):
        self.targets |= {v for k, v in attrs if k in ("src", "href")}


def test_index_html_names_every_stage_and_links_the_pictures(run_1f1b):
    written = run_1f1b[1]
    page = written["html"].read_text()
    for stage in range(PP):
        assert f"stage {stage}" in page
    parser = _Links()
    parser.feed(page)
    for name in ("timeline.png", "timeline.svg", "bubble.png", "loss.png", "collectives.png", "trace.json"):
        assert name in parser.targets
        assert (written["html"].parent / name).exists()
    assert "busbw" in page and "stage-skew" in page  # collective table and decisions table
    assert "summary.md" == written["markdown"].name and "| stage 3 |" in written["markdown"].read_text()


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=3, malformed_lines=5, decision=False)
    run = load_run(info.path)
    assert run.issues["summaries.jsonl"].skipped == 5
    assert len(run.summaries) == 2 * 3
    written = build_report(info.path)
    assert "Skipped 5 malformed line(s) in summaries.jsonl" in written["html"].read_text()


def test_the_report_names_the_runs_rank_order(tmp_path):
    """An older run's summaries carry no order: the default; a run in Megatron's order says so."""
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=2, with_spans=False, decision=False)
    assert load_run(info.path).config.order == "tp-pp-dp"
    path = info.path / "summaries.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**row, "order": "tp-dp-pp"}) + "\n" for row in rows))
    assert load_run(info.path).config.order == "tp-dp-pp"
    assert "tp-dp-pp" in build_report(info.path)["html"].read_text()


def test_nan_strings_decode_and_a_rollback_splits_the_loss_line(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=8, nan_loss_step=5)
    run = load_run(info.path)
    assert any(isinstance(s["loss"], float) and math.isnan(s["loss"]) for s in run.summaries)
    segments = loss_segments(run)
    assert [s for s, _ in segments[0]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in segments[1]] == [4, 5, 6, 7, 8]
    # Step 4 ran twice: the timeline draws its last execution, so 2m compute spans per stage.
    for spans in lane_spans(run, 4).values():
        assert sum(sp["kind"] in ("forward", "backward") for sp in spans) == 2 * 4
    written = build_report(info.path)
    assert "nonfinite-loss" in written["html"].read_text() and written["loss"].exists()


def test_a_run_without_spans_still_gets_plots_and_a_summary(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=3, with_spans=False)
    written = build_report(info.path)
    assert "timeline_png" not in written and "trace" not in written
    for key in ("bubble", "loss", "collectives", "html", "markdown"):
        assert written[key].exists()
    assert "No timeline could be drawn" in written["html"].read_text()


def test_cli_reports_a_missing_run_dir_in_one_line(tmp_path):
    from parwatch.cli.report import report

    missing = tmp_path / "no-such-run"
    result = CliRunner().invoke(report, [str(missing)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0]


def test_cli_rejects_a_step_without_spans_and_writes_elsewhere_with_out(tmp_path):
    from parwatch.cli.report import report

    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=4, sampled_steps=[2, 4])
    result = CliRunner().invoke(report, [str(info.path), "--step", "3"])
    assert result.exit_code == 1 and "steps with spans: [2, 4]" in result.output
    with pytest.raises(StepNotSampled):
        build_report(info.path, step=3)
    out = tmp_path / "elsewhere"
    result = CliRunner().invoke(
        report, [str(info.path), "--step", "2", "--out", str(out), "--price-per-gpu-hour", "3.5"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "timeline.png").exists() and not (info.path / "report").exists()
    page = (out / "index.html").read_text()
    assert "step 2" in page and "$3.50/GPU-hour" in page


def test_quantile_from_buckets_interpolates_like_prometheus():
    cum = [0] * len(COLLECTIVE_BUCKETS)
    i = COLLECTIVE_BUCKETS.index(2.5e-3)
    for j in range(i, len(cum)):
        cum[j] = 10  # ten observations in (1 ms, 2.5 ms]
    assert quantile_from_buckets(0.5, cum, 10) == pytest.approx(1e-3 + 0.5 * 1.5e-3)
    assert quantile_from_buckets(0.99, [0] * len(cum), 3) == COLLECTIVE_BUCKETS[-1]  # all in +Inf
    assert quantile_from_buckets(0.5, cum, 0) is None


def test_collective_series_falls_back_to_the_mean_without_buckets():
    rows = [
        {
            "rank": 0,
            "stage": 0,
            "step": 1,
            "collectives": [{"op": "all_reduce", "group": "tp", "count": 4, "seconds": 0.02, "bytes": 100}],
        }
    ]
    series, p99 = collective_series(rows)
    assert p99 is False and series[("all_reduce", "tp")] == [(1, pytest.approx(0.005))]


def test_bubble_table_and_cost_agree_with_the_summaries(run_1f1b):
    info = run_1f1b[0]
    run = load_run(info.path)
    rows = bubble_table(run.summaries, [0, 1, 2, 3])
    for row in rows:
        mine = [s for s in run.summaries if s["stage"] == row.stage and s["step"] > 1]
        # Time-weighted over the stage's ranks and steps (parwatch.bubble), not a mean of ratios.
        idle, compute = sum(s["idle_seconds"] for s in mine), sum(s["compute_seconds"] for s in mine)
        assert row.measured == pytest.approx(idle / (idle + compute))
        assert row.theoretical == pytest.approx((PP - 1) / (M + PP - 1))
    # The slowed stage idles less than the others, which wait for it.
    assert rows[2].measured < min(r.measured for r in rows if r.stage != 2)
    cost = cost_estimate(run.summaries, PP, M, 1, price=2.5)
    idle = sum(s["idle_seconds"] for s in run.summaries) / 3600
    compute = sum(s["compute_seconds"] for s in run.summaries) / 3600
    assert cost.idle_gpu_hours == pytest.approx(idle) and cost.idle_cost == pytest.approx(2.5 * idle)
    assert cost.recoverable_gpu_hours == pytest.approx(compute * (PP - 1) / (2 * M))


def test_fixture_bubble_is_near_the_formula_when_stages_are_uniform(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=4, microbatches=8, steps=3, p2p_seconds=1e-5)
    run = load_run(info.path)
    for row in bubble_table(run.summaries, [0, 1, 2, 3]):
        assert abs(row.excess) < 0.05, row


def test_the_report_shows_where_each_ranks_time_went(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=4, decision=False)
    # Rank 0 wrote its ledger at exit (a net partition); rank 1 only got as far as its summaries.
    ledger = {"productive": 6.0, "bubble_schedule": 2.0, "startup": 1.0, "wasted": 1.0}
    (info.path / "ledger-rank0.json").write_text(json.dumps({"rank": 0, "time_seconds": ledger}))
    (info.path / "ledger-rank1.json").write_text("{cut short")
    run = load_run(info.path)
    assert run.ledgers[0]["productive"] == 7.0  # as counters: gross
    assert set(run.ledgers) == {0}  # the synthetic summaries carry no ledger; the broken file is skipped
    written = build_report(info.path)
    assert Image.open(written["ledger"]).size[0] > 0
    text = written["markdown"].read_text()
    assert "## Where the time went (goodput ledger)" in text
    assert "time: goodput 60.0%, ETTR 80.0% of 10.0 rank-seconds" in text


def test_the_report_joins_a_ranks_processes_across_a_restart(tmp_path):
    """A crash after step 3 and a restart that resumed from checkpoint 2, both appending to one run dir:
    the gap between them is down, step 3's productive time wasted."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def row(step, started, startup, productive):
        return {
            **syn.summary(0, step),
            "process_start_time": started,
            "time_seconds": {"startup": startup, "productive": productive},
        }

    rows = [row(1, 100.0, 2.0, 1.0), row(2, 100.0, 2.0, 2.0), row(3, 100.0, 2.0, 3.0)]  # to t=105
    rows += [row(3, 110.0, 1.5, 1.0)]  # started at t=110
    (run_dir / "summaries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The new process wrote its ledger at exit: a net partition, later than its summaries.
    exit_ledger = {"process_start_time": 110.0, "rank": 0, "time_seconds": {"startup": 1.5, "productive": 2.0}}
    (run_dir / "ledger-rank0.json").write_text(json.dumps(exit_ledger))
    ledger = load_run(run_dir).ledgers[0]
    assert ledger == {"startup": 3.5, "productive": 5.0, "down": 5.0, "wasted": 1.0}


def test_decisions_come_from_the_sidecars_log_for_this_run_only(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=4, decision=False)
    run_id = json.loads((info.path / "summaries.jsonl").read_text().splitlines()[0])["run_id"]
    log = tmp_path / "state" / "decisions.jsonl"
    log.parent.mkdir()
    mine = Decision(
        id=1, run_id=run_id, time=1.0, step=3, rule="stage-skew", action="alert", source="rule", reason="", evidence={}
    )
    other = msgspec.structs.replace(mine, id=2, run_id="another-run", rule="loss-spike")
    log.write_text("".join(json.dumps(log_record(r)) + "\n" for r in (other, mine)))
    assert "No decisions recorded" in build_report(info.path)["markdown"].read_text()
    written = build_report(info.path, options=ReportOptions(decisions_path=str(log)))
    text = written["markdown"].read_text()
    assert "stage-skew" in text and "loss-spike" not in text


def test_a_schedule_without_a_closed_form_is_costed_against_its_replayed_theory():
    summaries = [
        {"idle_seconds": 0.1, "compute_seconds": 0.9, "bubble_theoretical_ratio": 0.04},
        {"idle_seconds": 0.1, "compute_seconds": 0.9, "bubble_theoretical_ratio": 0.04},
    ]
    c = cost_estimate(summaries, pp=2, microbatches=8, chunks=2, price=2.0, schedule="dualpipev")
    assert c.bubble_now == 0.04 and c.bubble_doubled is None and c.recoverable_gpu_hours == 0.0
    assert c.excess_idle_gpu_hours == pytest.approx(2 * (0.1 - 0.9 * 0.04 / 0.96) / 3600)
    formula = cost_estimate(summaries, pp=2, microbatches=8, chunks=2, price=2.0, schedule="interleaved1f1b")
    assert formula.bubble_now == pytest.approx(1 / 17) and formula.bubble_doubled == pytest.approx(1 / 33)


def test_every_nonfinite_step_is_marked_and_the_steps_kept_from_the_weights_are_listed(tmp_path):
    """Issue 42: the loss plot's x range stopped at the last finite loss, so one mark stood for many NaN
    steps; re-run and skipped steps (the check before the optimizer step) had no mark and no list."""
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=8, nan_loss_step=5)
    path = info.path / "summaries.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    checks = {2: ("rerun", "transient", True, [1]), 3: ("skip", "persistent", False, [1])}
    for s in lines:
        if s["step"] == 8:  # the replay's last steps NaN as well: past the last finite loss
            s["loss"] = "nan"
        if s["step"] in checks:
            action, triage, applied, ranks = checks[s["step"]]
            s["check"] = {
                "action": action,
                "fault": "step-nonfinite",
                "triage": triage,
                "applied": applied,
                "ranks": ranks,
            }
    path.write_text("".join(json.dumps(s) + "\n" for s in lines))
    run = load_run(info.path)

    from parwatch.report.plots import loss_figure

    ax = loss_figure(run).axes[0]
    marks = {c.get_label(): [x for x, _ in c.get_offsets()] for c in ax.collections}
    assert marks["non-finite loss"] == [5, 8]
    assert marks["re-run before the weights"] == [2] and marks["skipped before the weights"] == [3]
    low, high = ax.get_xlim()
    assert low < 1 and high > 8  # every mark inside the drawn range

    written = build_report(info.path)
    text = written["markdown"].read_text()
    section = text[text.index("## Steps kept from the weights") :]
    assert "| 2 | 0 | re-run | transient | step-nonfinite | 1 |" in section
    assert "| 3 | 0 | skipped | persistent | step-nonfinite | 1 |" in section
    assert "| 4..5 | 0 | rolled back | - | - | - |" in section
