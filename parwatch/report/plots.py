"""Plots over steps: bubble per stage, loss with guardrail decisions, collective latency."""

from __future__ import annotations

import math

from matplotlib import colormaps
from matplotlib.figure import Figure

from parwatch import ledger_view
from parwatch.report.loader import RunData
from parwatch.report.stats import collective_series, per_stage_series, stage_bubble_series
from parwatch.report.steps import checked
from parwatch.vocabulary import TimeCategory

_DPI = 100
_SIZE_PX = (1200, 480)
_SEGMENT_COLORS = ("#1F4E79", "#E07B00", "#2A9D8F", "#8E44AD", "#6D4C41")
_ACTION_COLORS = {"rollback": "#C62828", "pause": "#EF6C00", "resume": "#2E7D32", "alert": "#6A1B9A"}


def _figure(size_px=_SIZE_PX):
    fig = Figure(figsize=(size_px[0] / _DPI, size_px[1] / _DPI), dpi=_DPI)
    fig.subplots_adjust(left=0.08, right=0.80, top=0.90, bottom=0.12)
    ax = fig.add_subplot()
    ax.grid(True, color="#E0E0E0", linewidth=0.7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _no_data(ax, what: str) -> None:
    ax.text(
        0.5,
        0.5,
        f"no {what} in this run directory",
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=12,
        color="#666666",
    )


def _save(fig, path) -> None:
    fig.savefig(path, dpi=_DPI, facecolor="white")


def plot_bubble(run: RunData, path, size_px=_SIZE_PX) -> None:
    """Measured bubble per stage (parwatch.bubble's, over the stage's ranks), its schedule formula dashed."""
    fig, ax = _figure(size_px)
    measured = stage_bubble_series(run.summaries)
    theory = per_stage_series(run.summaries, "bubble_theoretical_ratio")
    colors = colormaps["tab10"]
    # Uniform stages share one formula: one dashed line then, instead of p lines drawn on top of each other.
    shared = len({tuple(pts) for pts in theory.values()}) == 1
    for i, (stage, pts) in enumerate(measured.items()):
        c = colors(i % 10)
        ax.plot([s for s, _ in pts], [100 * v for _, v in pts], color=c, marker=".", label=f"stage {stage}")
        th = theory.get(stage)
        if th and not shared:
            ax.plot(
                [s for s, _ in th],
                [100 * v for _, v in th],
                color=c,
                linestyle="--",
                linewidth=1.2,
                label=f"stage {stage} theory",
            )
    if shared:
        th = next(iter(theory.values()))
        ax.plot(
            [s for s, _ in th],
            [100 * v for _, v in th],
            color="#333333",
            linestyle="--",
            linewidth=1.3,
            label="schedule formula\n(all stages)",
        )
    if not measured:
        _no_data(ax, "bubble_ratio values")
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
        ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("bubble (% of idle + compute)")
    ax.set_title("Pipeline bubble per stage: measured (solid) vs schedule formula (dashed)")
    _save(fig, path)


def loss_segments(run: RunData) -> list[list]:
    """[(step, loss)] runs in file order (one rank's summaries are written in the order it
    shipped them), split where the step goes back (a replay after rollback).

    The loss comes from one rank: the one reporting it most often, preferring the last stage
    (it computes the loss) and then the lowest rank."""
    counts: dict[int, int] = {}
    for s in run.summaries:
        if isinstance(s.get("loss"), float):
            counts[s["rank"]] = counts.get(s["rank"], 0) + 1
    if not counts:
        return []
    last_stage = {s["rank"] for s in run.summaries if s["stage"] == run.config.pp - 1}
    rank = min(counts, key=lambda r: (-counts[r], r not in last_stage, r))
    mine = [s for s in run.summaries if s["rank"] == rank and isinstance(s.get("loss"), float)]
    segments: list = []
    last = None
    for s in mine:
        if last is None or s["step"] <= last:
            segments.append([])
        segments[-1].append((s["step"], s["loss"]))
        last = s["step"]
    return segments


def plot_loss(run: RunData, path, size_px=_SIZE_PX) -> None:
    """The loss figure (loss_figure), saved to `path`."""
    _save(loss_figure(run, size_px), path)


def loss_figure(run: RunData, size_px=_SIZE_PX) -> Figure:
    """Loss over steps; a mark at every step whose loss was not finite and every step the check before
    the optimizer step re-ran or skipped; vertical markers at decision steps labelled by action (and rule)."""
    fig, ax = _figure(size_px)
    segments = loss_segments(run)
    nonfinite = []
    every_step = [s for seg in segments for s, _ in seg]
    if every_step:  # the x range covers every step, the non-finite ones too (a mark past the line is seen)
        ax.set_xlim(min(every_step) - 0.5, max(every_step) + 0.5)
    for i, seg in enumerate(segments):
        finite = [(s, v) for s, v in seg if math.isfinite(v)]
        nonfinite += [s for s, v in seg if not math.isfinite(v)]
        label = "loss" if i == 0 else f"loss after rollback {i}"
        ax.plot(
            [s for s, _ in finite],
            [v for _, v in finite],
            marker=".",
            label=label,
            color=_SEGMENT_COLORS[i % len(_SEGMENT_COLORS)],
            linewidth=1.6 if i == 0 else 1.3,
        )
    if nonfinite:
        ax.scatter(
            nonfinite,
            [0.02] * len(nonfinite),
            transform=ax.get_xaxis_transform(),
            marker="X",
            s=80,
            color="#C62828",
            label="non-finite loss",
            zorder=5,
        )
    kept = checked(run)
    for what, marker, color, y in (("re-run", "o", "#2E7D32", 0.06), ("skipped", "v", "#C62828", 0.10)):
        steps = [k.first for k in kept if k.what.startswith(what)]
        if steps:
            ax.scatter(
                steps,
                [y] * len(steps),
                transform=ax.get_xaxis_transform(),
                marker=marker,
                s=60,
                facecolors="none" if marker == "o" else color,
                edgecolors=color,
                label=f"{what} before the weights",
                zorder=5,
            )
    for d in run.decisions:
        action = str(d.get("action", "?"))
        color = _ACTION_COLORS.get(action, "#555555")
        ax.axvline(d["step"], color=color, linestyle=":", linewidth=1.4)
        ax.text(
            d["step"],
            0.98,
            f" {action} ({d.get('rule', '?')})",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=9,
            color=color,
        )
    if not segments:
        _no_data(ax, "loss values")
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss, with guardrail decisions (dotted lines)")
    return fig


def plot_collectives(run: RunData, path, size_px=_SIZE_PX) -> bool:
    """Latency per (op, group) over steps; returns True when it shows p99 from buckets,
    False when it had to fall back to the mean seconds per op."""
    fig, ax = _figure(size_px)
    series, use_p99 = collective_series(run.summaries)
    for (op, group), pts in series.items():
        if pts:
            ax.plot([s for s, _ in pts], [1e3 * v for _, v in pts], marker=".", label=f"{op} ({group})")
    if not any(series.values()):
        _no_data(ax, "collective records")
    else:
        ax.set_yscale("log")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    what = (
        "p99 latency (ms), estimated from histogram buckets" if use_p99 else "mean latency per op (ms); buckets absent"
    )
    ax.set_ylabel(what)
    ax.set_xlabel("step")
    ax.set_title("Collective latency per op and group, all ranks")
    _save(fig, path)
    return use_p99


def plot_ledger(run: RunData, path, size_px=_SIZE_PX) -> None:
    """Where each rank's wall time went (the goodput ledger): one stacked bar per rank, in % of its time."""
    fig, ax = _figure(size_px)
    per_rank: dict[int, dict] = {}
    for rank, counters in sorted(run.ledgers.items()):
        total = ledger_view.totals([counters])
        if total and total["rank_seconds"] > 0:
            per_rank[rank] = total
    if not per_rank:
        _no_data(ax, "goodput ledgers (ledger-rank<N>.json or time_seconds)")
    else:
        categories = [c.value for c in TimeCategory]
        colors = colormaps["tab20"]
        ranks = list(per_rank)
        left = [0.0] * len(ranks)
        for i, category in enumerate(categories):
            shares = [100 * per_rank[r]["seconds"][category] / per_rank[r]["rank_seconds"] for r in ranks]
            if any(x > 0 for x in shares):
                ax.barh([f"rank {r}" for r in ranks], shares, left=left, color=colors(i % 20), label=category)
                left = [a + b for a, b in zip(left, shares)]
        ax.invert_yaxis()
        ax.set_xlim(0, 100)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    ax.set_xlabel("% of the rank's wall time, process start to exit")
    ax.set_title("Where the time went (goodput ledger)")
    _save(fig, path)
