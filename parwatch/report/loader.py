"""Read a run directory robustly: a bad line is skipped and counted, never fatal.

A run directory is written by processes that can crash mid-line, so every
file is read line by line; lines that are not JSON objects or lack the fields
a record needs are counted per file (with the first few reasons kept for the
report) and the rest of the file is still used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from parwatch import ledger_view
from parwatch.rank_layout import DEFAULT_ORDER, ORDERS
from parwatch.vocabulary import Outcome, RecordType, TimeCategory
from parwatch.wire.bounds import decode_float
from parwatch.wire.codec import BadRecord, parse
from parwatch.wire.log import check_log_record
from parwatch.wire.steps import StepSummary

SUMMARIES = "summaries.jsonl"
SPANS = "spans.jsonl"
DECISIONS = "decisions.jsonl"

_SPAN_INTS = ("rank", "stage", "step")
OUTCOMES = frozenset(Outcome)
_KEEP_REASONS = 5


class RunDirNotFound(FileNotFoundError):
    """The run directory does not exist or is not a directory."""


@dataclass
class FileIssues:
    skipped: int = 0
    """Lines skipped as malformed."""
    reasons: list = field(default_factory=list)
    """The first few 'line N: why' strings, for the report."""


@dataclass
class RunConfig:
    run_id: str = "?"
    schedule: str = "?"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatches: int = 1
    chunks: int = 1
    order: str = DEFAULT_ORDER
    """The rank order, fastest dimension first (parwatch.rank_layout): the summaries' own coordinates place
    each rank; this says how the run laid them out."""


@dataclass
class RunData:
    run_dir: Path
    summaries: list
    """StepSummary dicts, numbers decoded (loss may be float('nan'))."""
    spans: list
    """SpanRecord dicts with float start_s/end_s."""
    decisions: list
    """Records with type 'decision'."""
    applied: list
    """Outcome records (type applied, substituted, failed, ignored, mixed): what every rank did with a
    directive, one record per directive."""
    issues: dict
    """File name -> FileIssues; missing files appear with skipped 0 and a reason."""
    config: RunConfig
    ledgers: dict = field(default_factory=dict)
    """rank -> its goodput ledger as counters (parwatch.ledger_view): ledger-rank<N>.json, written at the
    rank's exit, else its newest summary's time_seconds (up to its last step boundary)."""
    state_dir: Path | None = None
    """Where the decisions' evidence bundles are (the directory of the decisions.jsonl read)."""

    def stage_ranks(self) -> dict[int, int]:
        """stage -> the rank drawn for it: tp_rank 0 and dp_rank 0 (lowest rank as a fallback)."""
        best: dict[int, tuple] = {}
        candidates = [
            ((s.get("tp_rank", 0) != 0 or s.get("dp_rank", 0) != 0), s["rank"], s["stage"]) for s in self.summaries
        ]
        # Ranks known only from spans have no layout: they rank after any tp 0 / dp 0 rank.
        candidates += [(True, sp["rank"], sp["stage"]) for sp in self.spans]
        for not_first, rank, stage in candidates:
            key = (not_first, rank)
            best[stage] = min(best.get(stage, key), key)
        return {stage: key[1] for stage, key in sorted(best.items())}

    def replay_gap_seconds(self) -> float:
        """Half the median step period: a hole this long within one step number means a replay."""
        periods = sorted(
            s["step_seconds"]
            for s in self.summaries
            if isinstance(s.get("step_seconds"), float) and s["step_seconds"] > 0
        )
        return 0.5 * periods[len(periods) // 2] if periods else 1.0

    def rank_info(self) -> dict[int, dict]:
        """rank -> {stage, tp_rank, dp_rank} from the newest summary of each rank (spans as a fallback)."""
        info = {sp["rank"]: {"stage": sp["stage"], "tp_rank": None, "dp_rank": None} for sp in self.spans}
        for s in self.summaries:
            info[s["rank"]] = {"stage": s["stage"], "tp_rank": s.get("tp_rank"), "dp_rank": s.get("dp_rank")}
        return dict(sorted(info.items()))


def split_replays(spans: list, gap_s: float) -> list[list]:
    """Spans sharing one step number, grouped into separate executions in time order.

    A rollback replays step numbers, so one step can occur twice in spans.jsonl. Within one
    execution some rank always has a span open (recv spans cover the waits), so a hole of
    more than `gap_s` in the union of the spans separates two executions."""
    groups: list[list] = []
    end = float("-inf")
    for sp in sorted(spans, key=lambda sp: sp["start_s"]):
        if not groups or sp["start_s"] > end + gap_s:
            groups.append([])
        groups[-1].append(sp)
        end = max(end, sp["end_s"])
    return groups


def _int(rec: dict, key: str) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRecord(f"field {key!r} must be an integer, got {v!r}")
    return v


def _summary(rec: dict) -> dict:
    """A summaries.jsonl line checked as the sidecar checks a posted one (StepSummary), kept as a dict
    with its loss decoded (float('nan') for "nan")."""
    summary = parse(rec, StepSummary, dotted=True)
    return {**rec, "loss": summary.loss}


def _span(rec: dict) -> dict:
    for key in _SPAN_INTS:
        _int(rec, key)
    if not isinstance(rec.get("kind"), str):
        raise BadRecord("field 'kind' must be a string")
    try:
        start, end = decode_float(rec.get("start_s")), decode_float(rec.get("end_s"))
    except ValueError as e:
        raise BadRecord(f"span time: {e}") from None
    if start is None or end is None or not (math.isfinite(start) and math.isfinite(end)) or end < start:
        raise BadRecord(f"span needs finite start_s <= end_s, got {rec.get('start_s')!r}..{rec.get('end_s')!r}")
    attrs = rec.get("attrs") or {}
    if not isinstance(attrs, dict):
        raise BadRecord("field 'attrs' must be an object")
    return {**rec, "start_s": start, "end_s": end, "attrs": attrs}


def _decision(rec: dict) -> dict:
    check_log_record(rec)
    return {**rec, "type": rec.get("type", RecordType.DECISION)}


def read_jsonl(path: Path, parse, issues: FileIssues) -> list:
    """Parse each line with `parse`; count and note lines that fail."""
    out: list = []
    if not path.exists():
        issues.reasons.append("file not found")
        return out
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
                out.append(parse(rec))
            except ValueError as e:  # json.JSONDecodeError and BadRecord are ValueErrors
                issues.skipped += 1
                if len(issues.reasons) < _KEEP_REASONS:
                    issues.reasons.append(f"line {n}: {str(e).splitlines()[0][:160]}")
    return out


def _config(summaries: list, spans: list) -> RunConfig:
    if not summaries:
        pp = 1 + max((sp["stage"] for sp in spans), default=0)
        return RunConfig(pp=pp)
    s = summaries[-1]
    ints = {k: s.get(k) for k in ("tp", "pp", "dp", "microbatches", "chunks")}
    ints = {k: v for k, v in ints.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    order = s.get("order") if s.get("order") in ORDERS else DEFAULT_ORDER  # none: an older summary's default
    return RunConfig(run_id=str(s.get("run_id", "?")), schedule=str(s.get("schedule", "?")), order=order, **ints)


def _ledgers(run_dir: Path, summaries: list) -> dict:
    """rank -> its ledger counters over the run: each of its processes' (a restart under the same run id
    appends to the same files) joined by ledger_view.across_restarts, the gaps between them as down."""
    newest: dict[tuple[int, float], dict] = {}  # (rank, process start) -> its newest counters
    productive: dict[tuple[int, float], list] = {}  # ... -> [(step, productive seconds so far)]
    for s in summaries:  # in the order written: a process's newest summary comes last
        ledger, started = s.get("time_seconds"), s.get("process_start_time")
        if isinstance(ledger, dict):
            key = (s["rank"], float(started) if isinstance(started, (int, float)) else 0.0)
            newest[key] = ledger
            productive.setdefault(key, []).append((s["step"], float(ledger.get(TimeCategory.PRODUCTIVE.value, 0.0))))
    for path in sorted(run_dir.glob("ledger-rank*.json")):
        try:  # the ledger a process wrote at exit: complete to its last second
            record = json.loads(path.read_text())
            rank, started = int(record["rank"]), float(record.get("process_start_time") or 0.0)
            counters = {k: float(v) for k, v in record["time_seconds"].items() if isinstance(v, (int, float))}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a ledger file cut short: the summaries' view stands
        same = [k for k in newest if k[0] == rank and ledger_view.same_process(k[1], started)]
        newest[same[0] if same else (rank, started)] = ledger_view.as_counters(counters)
    by_rank: dict[int, list[ledger_view.Process]] = {}
    for (rank, started), counters in newest.items():
        by_rank.setdefault(rank, []).append(ledger_view.Process(started, counters, productive.get((rank, started), ())))
    return {rank: ledger_view.across_restarts(processes) for rank, processes in by_rank.items()}


def load_run(run_dir, decisions_path=None) -> RunData:
    """Read summaries, spans and decisions of `run_dir`; raise RunDirNotFound if it is not a directory.

    decisions_path: the sidecar's decisions.jsonl (its --state-dir), when it is not in the run
    directory; only this run's records are read from it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirNotFound(f"run directory not found: {run_dir}")
    issues = {name: FileIssues() for name in (SUMMARIES, SPANS, DECISIONS)}
    summaries = read_jsonl(run_dir / SUMMARIES, _summary, issues[SUMMARIES])
    spans = read_jsonl(run_dir / SPANS, _span, issues[SPANS])
    records = read_jsonl(Path(decisions_path) if decisions_path else run_dir / DECISIONS, _decision, issues[DECISIONS])
    run_ids = {s.get("run_id") for s in summaries}
    if decisions_path and run_ids:  # a sidecar's log holds every run it watched
        records = [r for r in records if r.get("run_id") in run_ids or r.get("run_id") is None]
    return RunData(
        ledgers=_ledgers(run_dir, summaries),
        run_dir=run_dir,
        summaries=summaries,
        spans=spans,
        decisions=[r for r in records if r["type"] == RecordType.DECISION],
        applied=[r for r in records if r["type"] in OUTCOMES],
        issues=issues,
        config=_config(summaries, spans),
        state_dir=Path(decisions_path).parent if decisions_path else run_dir,
    )
