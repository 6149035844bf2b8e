"""The measured pipeline schedule of one step, drawn like the GPipe and Megatron figures.

One lane per stage (its tp_rank 0, dp_rank 0 rank): forward and backward
blocks numbered by microbatch, waits on p2p receives, optimizer / DP sync,
and idle as the grey that is left. Drawn on a bare matplotlib Figure (the Agg
renderer; no pyplot global state), at an exact pixel size.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parwatch.bubble import excess
from parwatch.report.loader import RunData, split_replays
from parwatch.vocabulary import SpanKind

COLORS = {
    "forward": "#3B75AF",
    "backward": "#519E3E",
    "comm": "#EF8636",
    "other": "#8D69B8",
    "idle": "#E4E4E4",
}
LABELS = {
    "forward": "forward",
    "backward": "backward",
    "comm": "waiting on recv / collective (bubble)",
    "other": "optimizer / DP sync / checkpoint",
    "idle": "idle, flush wait (bubble)",
}
_CATEGORY = {
    SpanKind.FORWARD: "forward",
    SpanKind.BACKWARD: "backward",
    SpanKind.RECV: "comm",
    SpanKind.COLLECTIVE: "comm",
    SpanKind.OPTIMIZER: "other",
    SpanKind.DP_SYNC: "other",
    SpanKind.CHECKPOINT: "other",
}
_DRAW_ORDER = ("comm", "other", "forward", "backward")  # later ones on top: nested TP collectives hide
_DPI = 100
_MARGIN_PX = {"left": 120, "right": 170, "top": 66, "bottom": 96}
# Excess bubble worth flagging in red: the default bubble-excess guardrail's threshold.
_EXCESS_FLAG = 0.10
_LANE_PX = 62


@dataclass
class LaneBubble:
    measured: float | None
    theoretical: float | None


def choose_step(run: RunData) -> int | None:
    """The last sampled step with spans from every stage's drawn rank, or None."""
    ranks = run.stage_ranks()
    if not ranks or len(ranks) < run.config.pp:
        return None
    wanted = set(ranks.items())
    seen: dict[int, set] = {}
    for sp in run.spans:
        seen.setdefault(sp["step"], set()).add((sp["stage"], sp["rank"]))
    full = [step for step, got in seen.items() if wanted <= got]
    return max(full) if full else None


def steps_with_spans(run: RunData) -> list[int]:
    return sorted({sp["step"] for sp in run.spans})


def lane_spans(run: RunData, step: int) -> dict[int, list]:
    """stage -> spans of that stage's drawn rank in `step` (stages without spans map to []).
    A step replayed after a rollback is drawn as it ran last."""
    ranks = run.stage_ranks()
    lanes: dict[int, list] = {stage: [] for stage in ranks}
    runs = split_replays([sp for sp in run.spans if sp["step"] == step], run.replay_gap_seconds())
    for sp in runs[-1] if runs else []:
        if ranks.get(sp["stage"]) == sp["rank"]:
            lanes[sp["stage"]].append(sp)
    return lanes


def _bubbles(run: RunData, step: int, lanes: dict, t0: float, t1: float) -> dict[int, LaneBubble]:
    """Per stage from the step's summary; from the spans where no summary came."""
    ranks = run.stage_ranks()
    out = {}
    for stage, rank in ranks.items():
        summ = next((s for s in run.summaries if s["step"] == step and s["rank"] == rank), None)
        if summ is not None and summ.get("bubble_ratio") is not None:
            out[stage] = LaneBubble(summ["bubble_ratio"], summ.get("bubble_theoretical_ratio"))
            continue
        busy = _union(
            [
                (s["start_s"], s["end_s"])
                for s in lanes[stage]
                if _CATEGORY.get(s["kind"]) in (SpanKind.FORWARD, SpanKind.BACKWARD, "other")
            ]
        )
        other = sum(s["end_s"] - s["start_s"] for s in lanes[stage] if _CATEGORY.get(s["kind"]) == "other")
        denom = (t1 - t0) - other
        out[stage] = LaneBubble((t1 - t0 - busy) / denom if lanes[stage] and denom > 0 else None, None)
    return out


def _union(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _pct(x) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def draw_timeline(
    run: RunData, step: int, png_path, svg_path=None, width_px: int = 1600, height_px: int | None = None
) -> dict:
    """Draw `step`; write the PNG (exactly width_px x height_px) and the SVG. Returns what it drew."""
    lanes = lane_spans(run, step)
    drawn = [sp for spans in lanes.values() for sp in spans]
    if not drawn:
        raise ValueError(f"step {step} has no spans; steps with spans: {steps_with_spans(run) or 'none'}")
    t0 = min(sp["start_s"] for sp in drawn)
    t1 = max(sp["end_s"] for sp in drawn)
    bubbles = _bubbles(run, step, lanes, t0, t1)
    stages = sorted(lanes)
    margin = _MARGIN_PX
    height_px = height_px or (margin["top"] + margin["bottom"] + _LANE_PX * len(stages))
    fig = Figure(figsize=(width_px / _DPI, height_px / _DPI), dpi=_DPI)
    fig.subplots_adjust(
        left=margin["left"] / width_px,
        right=1 - margin["right"] / width_px,
        top=1 - margin["top"] / height_px,
        bottom=margin["bottom"] / height_px,
    )
    ax = fig.add_subplot()
    axes_px = (width_px - margin["left"] - margin["right"], height_px - margin["top"] - margin["bottom"])
    span_ms = (t1 - t0) * 1e3
    for row, stage in enumerate(stages):
        _draw_lane(ax, row, lanes[stage], t0, span_ms, axes_px[0])
        _annotate_bubble(ax, row, bubbles.get(stage, LaneBubble(None, None)))
    _axes_and_titles(fig, ax, run, step, stages, span_ms, bubbles, width_px, height_px, axes_px)
    fig.savefig(png_path, dpi=_DPI, facecolor="white")
    if svg_path is not None:
        fig.savefig(svg_path, format="svg", facecolor="white")
    ranks = run.stage_ranks()
    return {
        "step": step,
        "stages": stages,
        "ranks": {s: ranks[s] for s in stages},
        "bubble": {s: (bubbles[s].measured, bubbles[s].theoretical) for s in stages},
        "width_ms": span_ms,
        "size_px": (width_px, height_px),
    }


def _draw_lane(ax, row: int, spans: list, t0: float, span_ms: float, axes_width_px: float) -> None:
    """Idle grey underneath, then waits, other, and compute on top (nested TP collectives hide)."""
    y = row - 0.4
    ax.broken_barh([(0, span_ms)], (y, 0.8), facecolors=COLORS["idle"], edgecolor="none", zorder=1)
    if not spans:
        ax.text(span_ms / 2, row, "no spans for this stage", ha="center", va="center", color="#666666")
    for z, cat in enumerate(_DRAW_ORDER, start=2):
        mine = [sp for sp in spans if _CATEGORY.get(sp["kind"]) == cat]
        bars = [((sp["start_s"] - t0) * 1e3, (sp["end_s"] - sp["start_s"]) * 1e3) for sp in mine]
        if bars:
            ax.broken_barh(bars, (y, 0.8), facecolors=COLORS[cat], edgecolor="white", linewidth=0.6, zorder=z)
        if cat in (SpanKind.FORWARD, SpanKind.BACKWARD) and bars and span_ms:
            _label_blocks(ax, mine, bars, row, axes_width_px / span_ms)


def _annotate_bubble(ax, row: int, b: LaneBubble) -> None:
    """Measured vs theoretical bubble right of the lane; red beyond the guardrail's excess threshold."""
    flagged = b.measured is not None and b.theoretical is not None and excess(b.measured, b.theoretical) > _EXCESS_FLAG
    ax.text(
        1.012,
        row,
        f"bubble {_pct(b.measured)}\ntheory {_pct(b.theoretical)}",
        transform=ax.get_yaxis_transform(),
        ha="left",
        va="center",
        fontsize=10,
        color="#B22222" if flagged else "#222222",
        linespacing=1.3,
    )


def _axes_and_titles(fig, ax, run, step, stages, span_ms, bubbles, width_px, height_px, axes_px) -> None:
    ranks = run.stage_ranks()
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}\nrank {ranks[s]}" for s in stages], fontsize=10)
    ax.set_ylim(len(stages) - 0.5, -0.5)  # stage 0 on top, as in the papers
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time from step start (ms)", fontsize=10)
    ax.tick_params(axis="x", labelsize=9)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#FFFFFF", linewidth=0.8, zorder=6, alpha=0.5)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    cfg = run.config
    chunks = f", v={cfg.chunks}" if cfg.chunks > 1 else ""
    known = [b for b in bubbles.values() if b.measured is not None]
    mean_m = sum(b.measured for b in known) / len(known) if known else None
    theo = next((b.theoretical for b in known if b.theoretical is not None), None)
    fig.suptitle(
        f"{cfg.schedule.upper()} pipeline, p={cfg.pp}, m={cfg.microbatches}{chunks}, "
        f"tp={cfg.tp}, dp={cfg.dp}: measured schedule of step {step}",
        fontsize=13,
        y=1 - 8 / height_px,
        va="top",
        x=(_MARGIN_PX["left"] + axes_px[0] / 2) / width_px,
    )
    ax.set_title(
        f"bubble (mean over stages): measured {_pct(mean_m)}, schedule formula {_pct(theo)}   ·   run {cfg.run_id}",
        fontsize=10,
        color="#444444",
        pad=6,
    )
    handles = [Patch(facecolor=COLORS[k], edgecolor="#999999", linewidth=0.5, label=LABELS[k]) for k in COLORS]
    # 48 px below the axes: under the tick labels and the axis label.
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -48 / axes_px[1]),
        ncol=len(handles),
        frameon=False,
        fontsize=10,
        handlelength=1.6,
        columnspacing=1.8,
    )


def _block_label(sp: dict) -> str | None:
    mb = sp["attrs"].get("microbatch")
    if mb is None:
        return None
    chunk = sp["attrs"].get("chunk", 0)
    return f"{mb}" if not chunk else f"{mb}.{chunk}"  # chunk shown for interleaved runs


def _label_blocks(ax, spans: list, bars: list, row: int, px_per_ms: float) -> None:
    """Microbatch numbers on one lane's forward (or backward) blocks: one font size for all of
    them, the largest at which the longest label fits the narrowest block, or none at all."""
    labels = [_block_label(sp) for sp in spans]
    longest = max((len(x) for x in labels if x), default=0)
    if not longest:
        return
    narrowest = min(w for _, w in bars) * px_per_ms
    for size in (10, 9, 8, 7):
        char_px = 0.62 * size * _DPI / 72  # bold DejaVu digits are about 0.62 em wide
        if narrowest >= char_px * longest + 3:
            for label, (x, w) in zip(labels, bars):
                if label:
                    ax.text(
                        x + w / 2,
                        row,
                        label,
                        ha="center",
                        va="center",
                        fontsize=size,
                        color="white",
                        fontweight="bold",
                        zorder=7,
                        clip_on=True,
                    )
            return
