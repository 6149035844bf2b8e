"""build_report: read a run directory and write every picture, the trace and the summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from parwatch.report.loader import SPANS, RunData, load_run
from parwatch.report.plots import plot_bubble, plot_collectives, plot_ledger, plot_loss
from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR
from parwatch.report.summary import build_sections, render_html, render_markdown
from parwatch.report.timeline import choose_step, draw_timeline, steps_with_spans
from parwatch.report.trace import write_trace


@dataclass
class ReportOptions:
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    """USD per accelerator-hour, for the idle cost lines."""
    timeline_width_px: int = 1600
    """Width of timeline.png; its height follows from the number of stages."""
    decisions_path: str | None = None
    """The sidecar's decisions.jsonl (STATE_DIR/decisions.jsonl) when the run directory has none."""


class StepNotSampled(ValueError):
    """--step names a step without spans."""


def _timeline_notes(run: RunData, step: int | None) -> tuple[int | None, list]:
    """The step to draw and, when there is none, a sentence saying why."""
    sampled = steps_with_spans(run)
    if step is not None:
        if step not in sampled:
            raise StepNotSampled(
                f"step {step} has no spans in {run.run_dir / SPANS}; steps with spans: {sampled or 'none'}"
            )
        return step, []
    if not run.spans:
        return None, [
            f"No timeline could be drawn: {SPANS} holds no spans (the collector samples spans "
            "only on some steps; run longer or sample more often)."
        ]
    chosen = choose_step(run)
    if chosen is None:
        have = sorted({sp["stage"] for sp in run.spans})
        return None, [
            f"No timeline could be drawn: no sampled step has spans from every stage's "
            f"tp 0 / dp 0 rank (p={run.config.pp}; stages seen in spans: {have}). "
            f"Pass --step with one of {sampled} to draw what there is."
        ]
    return chosen, []


def build_report(run_dir, step: int | None = None, out_dir=None, options: ReportOptions | None = None) -> dict:
    """Write the report for `run_dir` into `out_dir` (default RUN_DIR/report) and return
    {name: Path} of what was written (keys: timeline_png, timeline_svg, trace, bubble, loss,
    collectives, html, markdown; the timeline and trace keys are absent when there were no spans).

    Raises loader.RunDirNotFound for a missing run directory and StepNotSampled for a
    `step` without spans."""
    options = options or ReportOptions()
    run = load_run(run_dir, options.decisions_path)
    chosen, timeline_notes = _timeline_notes(run, step)  # raises before anything is written
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    images: dict[str, tuple] = {}
    notes = [
        f"Skipped {i.skipped} malformed line(s) in {name}: {'; '.join(i.reasons)}."
        for name, i in run.issues.items()
        if i.skipped
    ]
    notes += [
        f"{name} is missing."
        for name, i in run.issues.items()
        if not i.skipped and i.reasons == ["file not found"] and name != "decisions.jsonl"
    ]
    notes += timeline_notes
    if chosen is not None:
        written["timeline_png"], written["timeline_svg"] = out / "timeline.png", out / "timeline.svg"
        drawn = draw_timeline(
            run, chosen, written["timeline_png"], written["timeline_svg"], width_px=options.timeline_width_px
        )
        missing = [s for s in drawn["stages"] if not any(sp["stage"] == s and sp["step"] == chosen for sp in run.spans)]
        if missing:
            notes.append(f"Step {chosen} has no spans from stage(s) {missing}; their lanes are empty.")
        images["timeline"] = (
            "timeline.png",
            f"Measured pipeline schedule of step {chosen} (click for SVG)",
            "timeline.svg",
        )
    if run.spans:
        written["trace"] = write_trace(run, out / "trace.json")

    written["bubble"], written["loss"], written["collectives"] = (
        out / "bubble.png",
        out / "loss.png",
        out / "collectives.png",
    )
    written["ledger"] = out / "ledger.png"
    plot_ledger(run, written["ledger"])
    images["ledger"] = ("ledger.png", "Where each rank's wall time went (the goodput ledger, docs/goodput.md)", None)
    plot_bubble(run, written["bubble"])
    plot_loss(run, written["loss"])
    p99 = plot_collectives(run, written["collectives"])
    images["bubble"] = ("bubble.png", "Bubble per stage over steps; dashed: the schedule's formula", None)
    images["loss"] = ("loss.png", "Loss over steps; dotted lines: guardrail decisions", None)
    images["collectives"] = (
        "collectives.png",
        "Collective latency per op and group: "
        + ("p99 estimated from histogram buckets" if p99 else "mean seconds per op"),
        None,
    )

    title = f"parwatch report: {run.config.run_id}"
    sections = build_sections(
        run, images, notes, options.price_per_gpu_hour, "trace.json" if "trace" in written else None
    )
    written["html"], written["markdown"] = out / "index.html", out / "summary.md"
    written["html"].write_text(render_html(sections, title), encoding="utf-8")
    written["markdown"].write_text(render_markdown(sections, title), encoding="utf-8")
    return written
