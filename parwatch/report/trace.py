"""Spans as a Chrome trace (JSON object format) that ui.perfetto.dev and chrome://tracing open.

One process per rank, a few threads per process. Perfetto draws a thread's
complete ("X") events as one lane, so no two events of one lane may overlap
partially. Sends (an isend runs from posting to completion, over compute and
over other sends) and anything else that overlaps is spread over overflow
threads by greedy interval partitioning, which guarantees the invariant for
any input, including clocks that misbehave.
"""

from __future__ import annotations

import json
from pathlib import Path

from parwatch.report.loader import RunData, split_replays
from parwatch.vocabulary import GroupRole, SpanKind

# tid, thread name; the order is the display order in Perfetto.
LANES = {
    "steps": (0, "steps"),
    "compute": (1, "compute (forward/backward)"),
    "comm": (2, "communication (recv, collectives)"),
    "other": (3, "other (optimizer, DP sync, checkpoint)"),
    "tp": (4, "tp collectives"),
    "send": (5, "p2p sends in flight"),
}


def overflow_tid(base_tid: int, k: int) -> int:
    """Thread id of sub-lane k (k >= 1) of a lane: above every base tid, so no two lanes collide."""
    return 1000 + 100 * base_tid + k


def lane_of(span: dict) -> str:
    kind, attrs = span["kind"], span["attrs"]
    if kind in (SpanKind.FORWARD, SpanKind.BACKWARD):
        return "compute"
    if kind in (SpanKind.OPTIMIZER, SpanKind.DP_SYNC, SpanKind.CHECKPOINT):
        return "other"
    if kind == SpanKind.SEND:
        return SpanKind.SEND
    if kind == SpanKind.COLLECTIVE and attrs.get("group") == GroupRole.TP:
        return GroupRole.TP  # nested inside forward/backward: a lane of their own
    return "comm"


def event_name(span: dict) -> str:
    kind, a = span["kind"], span["attrs"]
    mb = a.get("microbatch")
    chunk = f" c{a['chunk']}" if a.get("chunk") else ""
    if kind in (SpanKind.FORWARD, SpanKind.BACKWARD):
        return f"{'F' if kind == SpanKind.FORWARD else 'B'} mb{mb}{chunk}"
    if kind in (SpanKind.SEND, SpanKind.RECV):
        way = "to" if kind == SpanKind.SEND else "from"
        return f"{kind} {a.get('what', '')} mb{mb}{chunk} {way} stage {a.get('peer', '?')}".replace("  ", " ")
    if kind == SpanKind.COLLECTIVE:
        return f"{a.get('op', 'collective')} {a.get('group', '')}".strip()
    return kind


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _partition(items: list) -> list[int]:
    """Sub-lane index per (start_ns, end_ns) so that no two in one sub-lane overlap;
    events that only touch (end == next start) share a sub-lane."""
    order = sorted(range(len(items)), key=lambda i: (items[i][0], -items[i][1]))
    ends: list[int] = []
    out = [0] * len(items)
    for i in order:
        start, end = items[i]
        k = next((k for k, e in enumerate(ends) if e <= start), None)
        if k is None:
            k = len(ends)
            ends.append(end)
        ends[k] = end
        out[i] = k
    return out


def _step_slices(spans: list, gap_s: float) -> list[dict]:
    """One synthetic 'step N' slice per rank and execution of a step (a rollback replays step
    numbers), from its first span to its last."""
    by_key: dict[tuple, list] = {}
    for sp in spans:
        by_key.setdefault((sp["rank"], sp["step"]), []).append(sp)
    out = []
    for (rank, step), group in by_key.items():
        for i, execution in enumerate(split_replays(group, gap_s)):
            out.append(
                {
                    "rank": rank,
                    "stage": None,
                    "step": step,
                    "kind": "step",
                    "start_s": min(sp["start_s"] for sp in execution),
                    "end_s": max(sp["end_s"] for sp in execution),
                    "attrs": {"replay": i} if i else {},
                }
            )
    return out


def build_trace(run: RunData) -> dict:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}."""
    if not run.spans:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"run_id": run.config.run_id}}
    origin = _ns(min(sp["start_s"] for sp in run.spans))
    by_lane: dict[tuple, list] = {}
    for sp in run.spans:
        by_lane.setdefault((sp["rank"], lane_of(sp)), []).append(sp)
    for sp in _step_slices(run.spans, run.replay_gap_seconds()):
        by_lane.setdefault((sp["rank"], "steps"), []).append(sp)
    events, threads = [], {}
    for (rank, lane), spans in sorted(by_lane.items()):
        base_tid, base_name = LANES[lane]
        times = [(_ns(sp["start_s"]) - origin, _ns(sp["end_s"]) - origin) for sp in spans]
        for sp, (a, b), k in zip(spans, times, _partition(times)):
            tid = base_tid if k == 0 else overflow_tid(base_tid, k)
            threads[(rank, tid)] = (base_name if k == 0 else f"{base_name} #{k + 1}", 1000 * base_tid + k)
            events.append(
                {
                    "name": f"step {sp['step']}" if lane == "steps" else event_name(sp),
                    "cat": sp["kind"],
                    "ph": "X",
                    "ts": a / 1000,
                    "dur": (b - a) / 1000,
                    "pid": rank,
                    "tid": tid,
                    "args": {"step": sp["step"], **{k2: v for k2, v in sp["attrs"].items() if _plain(v)}},
                }
            )
    return {
        "traceEvents": _metadata(run, threads) + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run_id": run.config.run_id,
            "schedule": run.config.schedule,
            "tp": run.config.tp,
            "pp": run.config.pp,
            "dp": run.config.dp,
            "order": run.config.order,
            "microbatches": run.config.microbatches,
        },
    }


def _plain(v) -> bool:
    return isinstance(v, (str, int, float, bool)) or v is None


def _metadata(run: RunData, threads: dict) -> list[dict]:
    info = run.rank_info()
    meta = []
    for rank in sorted({r for r, _ in threads}):
        i = info.get(rank, {})
        layout = f" · tp {i['tp_rank']} · dp {i['dp_rank']}" if i.get("tp_rank") is not None else ""
        name = f"rank {rank} · stage {i.get('stage', '?')}{layout}"
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for (rank, tid), (name, order) in sorted(threads.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": order}})
    return meta


def write_trace(run: RunData, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(build_trace(run), separators=(",", ":")))
    return path
