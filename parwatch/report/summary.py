"""The one-page summary: built once as sections, rendered as HTML (index.html) and Markdown."""

from __future__ import annotations

import datetime as dt
import html
from dataclasses import dataclass, field

from parwatch import ledger_view
from parwatch.report.loader import RunData
from parwatch.report.stats import bubble_table, collective_totals, cost_estimate, self_cost_shares
from parwatch.report.steps import kept_from_weights
from parwatch.vocabulary import Outcome, TimeCategory
from parwatch.wire.findings import bundle_of


@dataclass
class Section:
    title: str
    paragraphs: list = field(default_factory=list)
    headers: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    images: list = field(default_factory=list)
    """(file name relative to the report, caption, optional link target)."""
    links: list = field(default_factory=list)
    """(target, text) pairs shown as one line of links."""


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(x) -> str:
    return "n/a" if x is None else f"{1e3 * x:.3f} ms"


def _rate(x) -> str:
    return "n/a" if x is None else f"{x / 1e9:.2f} GB/s"


def _hours(x: float) -> str:
    return f"{x:,.1f}" if x >= 100 else f"{x:.4g}"


def _money(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 else f"${x:.4f}"


def _when(t) -> str:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "?"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def build_sections(
    run: RunData, images: dict, notes: list, price_per_gpu_hour: float, trace_name: str | None
) -> list[Section]:
    """images: key -> (file name, caption, link or None); notes: plain sentences for the top."""
    cfg = run.config
    steps = sorted({s["step"] for s in run.summaries})
    stages = sorted(run.stage_ranks())
    ranks = sorted({s["rank"] for s in run.summaries} | {sp["rank"] for sp in run.spans})
    out = [
        Section(
            "Run",
            headers=["setting", "value"],
            rows=[
                ["run id", cfg.run_id],
                ["schedule", cfg.schedule],
                ["tp x pp x dp", f"{cfg.tp} x {cfg.pp} x {cfg.dp} ({len(ranks)} ranks seen)"],
                ["rank order (fastest first)", cfg.order],
                ["microbatches (m)", str(cfg.microbatches)],
                ["chunks per stage (v)", str(cfg.chunks)],
                ["steps", f"{steps[0]}..{steps[-1]} ({len(steps)} distinct)" if steps else "none"],
                ["summaries / spans read", f"{len(run.summaries)} / {len(run.spans)}"],
            ],
        )
    ]
    if notes:
        out.append(Section("Notes", paragraphs=list(notes)))

    rows = []
    for b in bubble_table(run.summaries, stages):
        rows.append(
            [
                f"stage {b.stage}",
                f"rank {run.stage_ranks()[b.stage]}",
                _pct(b.measured),
                _pct(b.theoretical),
                _pct(b.excess),
                str(b.steps),
            ]
        )
    out.append(
        Section(
            "Bubble per stage",
            headers=["stage", "drawn rank", "measured", "theoretical", "excess", "steps"],
            rows=rows,
            paragraphs=[
                "Idle over idle + compute, summed over the stage's ranks and the steps after the first (it carries "
                "warm-up): the figure the guardrail, the dashboard and the alerts use. Theoretical is the "
                "schedule's formula (p-1)/(v*m+p-1), or, for zero-bubble and V schedules, the replay of its own "
                "action order at equal action times; "
                "the excess is what balance, p2p or the executor cost beyond the schedule."
            ],
        )
    )

    if run.summaries:
        c = cost_estimate(run.summaries, cfg.pp, cfg.microbatches, cfg.chunks, price_per_gpu_hour, cfg.schedule)
        p = f"${price_per_gpu_hour:.2f}/GPU-hour"
        doubling = (
            f"{_pct(c.bubble_doubled)} at m={2 * cfg.microbatches} (same work split into twice as many half-size "
            "microbatches; compute unchanged)"
            if c.bubble_doubled is not None
            else f"{cfg.schedule} has no closed form: its bubble at m={2 * cfg.microbatches} is not claimed"
        )
        out.append(
            Section(
                "Idle accelerator time and cost",
                headers=["quantity", "GPU-hours", f"cost at {p}"],
                rows=[
                    ["idle (sum over ranks of idle_seconds)", _hours(c.idle_gpu_hours), _money(c.idle_cost)],
                    ["idle beyond the schedule's bubble", _hours(c.excess_idle_gpu_hours), _money(c.excess_cost)],
                    [
                        f"recoverable by doubling microbatches (m={cfg.microbatches} -> {2 * cfg.microbatches})",
                        _hours(c.recoverable_gpu_hours) if c.bubble_doubled is not None else "n/a",
                        _money(c.recoverable_cost) if c.bubble_doubled is not None else "n/a",
                    ],
                ],
                paragraphs=[f"Schedule bubble share: {_pct(c.bubble_now)} at m={cfg.microbatches}, {doubling}."],
            )
        )

    colls = collective_totals(run.summaries)
    out.append(
        Section(
            "Collectives (all ranks, all steps)",
            headers=["op", "group", "count", "mean", "p50", "p99", "total bytes", "busbw"],
            rows=[
                [
                    c.op,
                    c.group,
                    f"{c.count:.0f}",
                    _ms(c.mean()),
                    _ms(c.quantile(0.5)),
                    _ms(c.quantile(0.99)),
                    f"{c.bytes:.3g}",
                    _rate(c.busbw()),
                ]
                for c in colls
            ],
            paragraphs=[] if colls else ["No collective records in the summaries."],
        )
    )

    applied = {a.get("directive_id"): a for a in run.applied}
    dec_rows = []
    for d in run.decisions:
        a = applied.get(d.get("directive_id")) if d.get("directive_id") is not None else None
        done = _outcome_text(a) if a else ("not applied" if d.get("directive_id") is not None else "-")
        dec_rows.append(
            [
                str(d["step"]),
                _when(d.get("time")),
                str(d.get("rule", "?")),
                str(d.get("action", "?")),
                str(d.get("source", "?")),
                "yes" if d.get("enforced", True) else "no (dry run)",
                str(d.get("checkpoint") if d.get("checkpoint") is not None else "-"),
                str(d.get("skip_batches", 0)),
                done,
                str(d.get("reason", "")),
            ]
        )
    out.append(
        Section(
            "Guardrail decisions",
            headers=[
                "step",
                "time",
                "rule",
                "action",
                "source",
                "enforced",
                "checkpoint",
                "skip batches",
                "outcome",
                "reason",
            ],
            rows=dec_rows,
            paragraphs=_evidence_lines(run)
            if dec_rows
            else [
                "No decisions recorded. The sidecar writes them to its state directory: "
                "parwatch report RUN_DIR --decisions STATE_DIR/decisions.jsonl reads them from there."
            ],
        )
    )

    kept = kept_from_weights(run)
    out.append(
        Section(
            "Steps kept from the weights",
            headers=["steps", "timeline", "what", "triage", "fault", "ranks"],
            rows=[
                [k.steps, str(k.timeline), k.what, k.triage or "-", k.fault or "-", ", ".join(map(str, k.ranks)) or "-"]
                for k in kept
            ],
            paragraphs=[
                "Re-run: the check before the optimizer step found the step bad (a NaN/inf, a loss spike) and its "
                "re-run on the same microbatches passed: that update went in (transient). Skipped: the re-run "
                "failed too, no update went in (persistent, data-caused); paused: skips kept coming. Rolled back: "
                "steps a rollback discarded (their summaries' timeline ends past the checkpoint loaded). The work "
                "of each is wasted time in the goodput ledger."
            ]
            if kept
            else ["Every step's update went in as first computed: none re-run, skipped or rolled back."],
        )
    )
    out.append(_ledger_section(run))
    out.append(_self_cost_section(run))
    pics = Section(
        "Pictures", images=[images[k] for k in ("timeline", "ledger", "bubble", "loss", "collectives") if k in images]
    )
    if trace_name:
        pics.paragraphs.append(
            "The full span trace opens in Perfetto (drag the file onto the page) or "
            "chrome://tracing; one process per rank."
        )
        pics.links += [
            (trace_name, f"{trace_name} (Chrome trace JSON)"),
            ("https://ui.perfetto.dev", "ui.perfetto.dev"),
        ]
    out.append(pics)
    return out


def render_html(sections: list[Section], title: str) -> str:
    e = html.escape
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>',
        "<style>body{font-family:system-ui,sans-serif;max-width:1640px;margin:2em auto;padding:0 1em;"
        "color:#222}table{border-collapse:collapse;margin:.5em 0 1em}td,th{border:1px solid #ccc;"
        "padding:.25em .6em;text-align:left;font-size:.92em}th{background:#f3f3f3}img{max-width:100%;"
        "border:1px solid #ddd}figure{margin:1em 0}figcaption{color:#555;font-size:.9em}</style>",
        f"</head><body><h1>{e(title)}</h1>",
    ]
    for s in sections:
        parts.append(f"<h2>{e(s.title)}</h2>")
        parts += [f"<p>{e(p)}</p>" for p in s.paragraphs]
        if s.links:
            parts.append("<p>" + " · ".join(f'<a href="{e(t)}">{e(x)}</a>' for t, x in s.links) + "</p>")
        if s.headers and s.rows:
            parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in s.headers) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in s.rows]
            parts.append("</table>")
        for name, caption, link in s.images:
            img = f'<img src="{e(name)}" alt="{e(caption)}">'
            parts.append(f'<figure><a href="{e(link or name)}">{img}</a><figcaption>{e(caption)}</figcaption></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_markdown(sections: list[Section], title: str) -> str:
    def cell(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = [f"# {title}", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        for p in s.paragraphs:
            lines += [p, ""]
        if s.links:
            lines += [" · ".join(f"[{x}]({t})" for t, x in s.links), ""]
        if s.headers and s.rows:
            lines.append("| " + " | ".join(cell(h) for h in s.headers) + " |")
            lines.append("|" + "---|" * len(s.headers))
            lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in s.rows]
            lines.append("")
        for name, caption, link in s.images:
            lines += [f"[![{caption}]({name})]({link or name})", "", f"*{caption}*", ""]
    return "\n".join(lines)


def _outcome_text(record: dict) -> str:
    """An outcome record in a few words: what happened, where, on how many ranks."""
    kind = record.get("type", "?")
    ranks = record.get("rank_count")
    text = f"{kind} at step {record.get('step')}" + (f" ({ranks} ranks)" if ranks else "")
    if kind == Outcome.SUBSTITUTED:
        text += f": loaded {record.get('loaded_step')} instead of {record.get('requested_step')}"
    elif record.get("reasons"):
        text += ": " + ", ".join(f"{k} x{v}" for k, v in record["reasons"].items())
    return text


def _self_cost_section(run: RunData) -> Section:
    shares = self_cost_shares(run.summaries)
    if shares is None:
        return Section("parwatch's own cost", paragraphs=["No summary carries self_seconds (a collector before 0.1)."])
    return Section(
        "parwatch's own cost",
        headers=["part", "share of the step"],
        rows=[[part.replace("_", " "), _pct(share)] for part, share in shares.items()],
        paragraphs=[
            "Time in parwatch on each rank over its steps: span hooks and the collector run on the training thread "
            "(their sum, training thread, is what a step can lose); the shipper and activity threads' CPU runs "
            "beside it (benchmarks/collector_overhead.py compares it with steps run with and without parwatch)."
        ],
    )


def _ledger_section(run: RunData) -> Section:
    """Where the time went: each rank's ledger (seconds and share per category), then all ranks."""
    rows = []
    for rank, counters in sorted(run.ledgers.items()):
        rows.append(_ledger_row(f"rank {rank}", ledger_view.totals([counters])))
    total = ledger_view.totals(run.ledgers.values())
    if len(rows) > 1:
        rows.append(_ledger_row("all ranks", total))
    top = [c.value for c in TimeCategory]
    return Section(
        "Where the time went (goodput ledger)",
        headers=["ranks", "wall s", "goodput", "ETTR", *top],
        rows=rows,
        paragraphs=[ledger_view.line(total)]
        + ([] if rows else ["No ledger: the collectors predate it or wrote no ledger-rank<N>.json."])
        + ["Every second of a rank from process start to exit is in one category; docs/goodput.md."],
    )


def _ledger_row(label: str, total) -> list:
    if not total:
        return [label, "n/a", "n/a", "n/a", *(["n/a"] * len(TimeCategory))]
    wall = total["rank_seconds"]
    return [
        label,
        f"{wall:.1f}",
        _pct(total["goodput_ratio"]),
        _pct(total["ettr"]),
        *(
            f"{total['seconds'][c.value]:.2f} ({_pct(total['seconds'][c.value] / wall if wall else None)})"
            for c in TimeCategory
        ),
    ]


def _evidence_lines(run) -> list[str]:
    """Where each hang or crash decision's evidence (every reachable rank's stacks, last spans, activity)
    is kept, and which ranks it holds."""
    lines = []
    for d in run.decisions:
        bundle = bundle_of(d)
        if not bundle:
            continue
        folder = (run.state_dir or run.run_dir) / bundle
        ranks = sorted(int(f.stem[4:]) for f in folder.glob("rank*.json") if f.stem[4:].isdigit())
        held = (
            f"ranks {', '.join(map(str, ranks))}" if ranks else "no rank's evidence (none reachable, or not kept here)"
        )
        lines.append(
            f"Evidence of decision {d.get('id')} ({d.get('rule')}, step {d.get('step')}): {folder} holds {held}."
        )
    return lines
