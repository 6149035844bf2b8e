"""Decode + validate the two hot posts, three ways side by side in one process: msgspec Structs (the
records parwatch uses, parwatch/wire/activity.py), pydantic models of the same fields and bounds, and the
hand-written decoder they replaced (a copy of parwatch/sidecar/digest.py at 12b600f: pydantic-core's
JSON parser, then a check per field in Python).

    python benchmarks/wire_decode.py [--runs 3] [--seconds 1.0] [--out benchmarks/results/wire_decode.json]

Bodies: a node digest of 64 ranks (of a tp 8 x pp 16 x dp 16 run) and one rank's activity post. Every
decoder ends with the same rows (parwatch.wire.activity.Activity) after the same checks against the layout
(ranks inside the run's world, coordinates matching the rank). Figure: microseconds per decode, each
run the mean over a loop of --seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from msgspec.structs import astuple, replace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_jiffies, print_table, stolen_share, write_json  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from pydantic_core import from_json  # noqa: E402

from parwatch.rank_layout import RankLayout  # noqa: E402
from parwatch.sidecar.digest import digest_rows, in_layout, layout_of  # noqa: E402
from parwatch.wire.activity import ROW_FIELDS, Activity, ActivityPost, NodeDigest  # noqa: E402
from parwatch.wire.bounds import (  # noqa: E402  # noqa: E402
    MAX_COUNT,
    MAX_ERROR_CHARS,
    MAX_HOST,
    MAX_PID,
    MAX_SECONDS,
    MAX_STEP,
    MAX_TEXT,
    MAX_TIME,
    MAX_WORLD,
)
from parwatch.wire.codec import decode  # noqa: E402

RANKS = 64
LAYOUT = RankLayout(8, 16, 16)


def bodies(now: float = 1.7e9) -> tuple[bytes, bytes]:
    rows = []
    for rank in range(RANKS):
        stage, tp_rank, dp_rank = (rank // 8) % 16, rank % 8, rank // 128
        waiting = rank % 8 == 0
        rows.append(
            astuple(
                Activity(
                    rank,
                    "running",
                    "collective" if waiting else "forward",
                    "all_reduce" if waiting else None,
                    "tp" if waiting else None,
                    None,
                    1234 if waiting else None,
                    now - 0.2,
                    41,
                    0.5,
                    100_000 + rank,
                    "node-3.cluster.example",
                    stage,
                    tp_rank,
                    dp_rank,
                    now,
                    now - 0.4,
                    None,
                )
            )
        )
    digest = {"version": 1, "node": "node-3:9401", "run_id": "run-2026-12-02", "time": now, "layout": [8, 16, 16]}
    activity = dict(zip(ROW_FIELDS, rows[9]))
    activity.update(run_id="run-2026-12-02", tp=8, pp=16, dp=16)
    return (
        json.dumps({**digest, "rows": rows}, separators=(",", ":")).encode(),
        json.dumps({"version": 1, "activity": activity}, separators=(",", ":")).encode(),
    )


# -- msgspec: what the sidecar runs ----------------------------------------------------------------------
def msgspec_digest(raw: bytes) -> list[Activity]:
    d = decode(raw, NodeDigest, "digest")
    return digest_rows(d.rows, layout_of(d.layout, d.order, "digest.layout"))


def msgspec_activity(raw: bytes) -> Activity:
    a = decode(raw, ActivityPost, "").activity
    return in_layout(a.row(), layout_of((a.tp, a.pp, a.dp), a.order, "activity [tp, pp, dp]"), "activity")


# -- pydantic: the same fields and bounds --------------------------------------------------------------
_TEXT = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
P = {"strict": True}
Rank = Annotated[int, Field(ge=0, lt=MAX_WORLD, **P)]
Par = Annotated[int, Field(ge=1, le=MAX_WORLD, **P)]
Time = Annotated[float, Field(ge=0, le=MAX_TIME, allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=MAX_TEXT, pattern=_TEXT)]
Host = Annotated[str, Field(max_length=MAX_HOST, pattern=_TEXT)]
Pid = Annotated[int, Field(ge=0, le=MAX_PID, **P)]
Step = Annotated[int, Field(ge=-1, lt=MAX_STEP, **P)]
Seq = Annotated[int, Field(ge=0, le=MAX_COUNT, **P)]
Secs = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Err = Annotated[str, Field(max_length=MAX_ERROR_CHARS, pattern=_TEXT)]


class PRow(NamedTuple):
    rank: Rank
    state: Literal["running", "done", "crashed", "gone", "silent"]
    kind: Text | None
    op: Text | None
    group: Text | None
    peer: Rank | None
    seq: Seq | None
    since: Time | None
    step: Step
    step_seconds: Secs | None
    pid: Pid
    host: Host
    stage: Rank
    tp_rank: Rank
    dp_rank: Rank
    time: Time
    step_end: Time | None = None
    error: Err | None = None


class PDigest(BaseModel):
    version: Literal[1]
    node: Annotated[str, Field(min_length=1, max_length=MAX_HOST + 6, pattern=_TEXT)]
    run_id: Annotated[str, Field(max_length=128, pattern=_TEXT)] | None
    time: Time
    layout: tuple[Par, Par, Par]
    rows: Annotated[list[PRow], Field(max_length=MAX_WORLD)]


class PReport(BaseModel):
    model_config = ConfigDict(extra="ignore")
    run_id: Annotated[str, Field(max_length=128, pattern=_TEXT)] | None = None
    rank: Rank
    pid: Pid
    host: Host | None = None
    stage: Rank
    tp_rank: Rank
    dp_rank: Rank
    tp: Par
    pp: Par
    dp: Par
    state: Literal["running", "done", "crashed"] = "running"
    step: Step
    step_seconds: Secs | None = None
    kind: Text | None = None
    op: Text | None = None
    group: Text | None = None
    peer: Rank | None = None
    seq: Seq | None = None
    since: Time | None = None
    time: Time
    step_end: Time | None = None
    error: Err | None = None


class PPost(BaseModel):
    version: Literal[1]
    activity: PReport


def pydantic_digest(raw: bytes) -> list[Activity]:
    d = PDigest.model_validate_json(raw)
    return digest_rows([Activity(*r) for r in d.rows], layout_of(d.layout, d.order, "digest.layout"))


def pydantic_activity(raw: bytes) -> Activity:
    a = PPost.model_validate_json(raw).activity
    row = Activity(*(getattr(a, f) for f in ROW_FIELDS[:-2]), a.step_end, a.error)
    return in_layout(
        replace(row, host=a.host or ""), layout_of((a.tp, a.pp, a.dp), a.order, "activity [tp, pp, dp]"), "activity"
    )


# -- the hand-written decoder it replaced (parwatch/sidecar/digest.py at 12b600f, its decoding part) --------
class Bad(ValueError):
    pass


def _int(v: dict, f: str, where: str, lo: int, hi: int, optional: bool = False):
    x = v.get(f)
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise Bad(f"{where}.{f} must be {'null or ' if optional else ''}an integer in {lo}..{hi}, got {x!r}")
    return x


def _float(v: dict, f: str, where: str, lo: float, hi: float, optional: bool = True):
    x = v.get(f)
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
        raise Bad(f"{where}.{f} must be {'null or ' if optional else ''}a number in {lo:g}..{hi:g}, got {x!r}")
    return float(x)


def _text(v: dict, f: str, where: str, limit: int, optional: bool = True):
    x = v.get(f)
    if x is None and optional:
        return None
    if not isinstance(x, str) or len(x) > limit or not x.isprintable():
        raise Bad(f"{where}.{f} must be a printable string of at most {limit} characters")
    return x


def _layout(value, where: str) -> RankLayout:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)
    ):
        raise Bad(f"{where} must be [tp, pp, dp], three integers >= 1, got {value!r}")
    layout = RankLayout(*value)
    if layout.world > MAX_WORLD:
        raise Bad(f"{where} is a world of {layout.world} ranks")
    return layout


def _row(v: dict, layout: RankLayout, where: str, states: tuple[str, ...]) -> Activity:
    world = layout.world
    rank = _int(v, "rank", where, 0, world - 1)
    stage = _int(v, "stage", where, 0, layout.pp - 1)
    tp_rank = _int(v, "tp_rank", where, 0, layout.tp - 1)
    dp_rank = _int(v, "dp_rank", where, 0, layout.dp - 1)
    if rank != layout.rank_of(tp_rank, stage, dp_rank):
        raise Bad(f"{where}: rank {rank} is not its coordinates")
    state = v.get("state")
    if state not in states:
        raise Bad(f"{where}.state must be one of {', '.join(states)}, got {state!r}")
    error = v.get("error")
    if error is not None:
        if not isinstance(error, str):
            raise Bad(f"{where}.error must be null or a string")
        error = "".join(c if c.isprintable() else " " for c in error[:MAX_ERROR_CHARS])
    return Activity(
        rank=rank,
        state=state,
        kind=_text(v, "kind", where, MAX_TEXT),
        op=_text(v, "op", where, MAX_TEXT),
        group=_text(v, "group", where, MAX_TEXT),
        peer=_int(v, "peer", where, 0, world - 1, optional=True),
        seq=_int(v, "seq", where, 0, MAX_COUNT, optional=True),
        since=_float(v, "since", where, 0.0, MAX_TIME),
        step=_int(v, "step", where, -1, MAX_STEP - 1),
        step_seconds=_float(v, "step_seconds", where, 0.0, MAX_SECONDS),
        pid=_int(v, "pid", where, 0, MAX_PID),
        host=_text(v, "host", where, MAX_HOST, optional=False),
        stage=stage,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        time=_float(v, "time", where, 0.0, MAX_TIME, optional=False),
        step_end=_float(v, "step_end", where, 0.0, MAX_TIME),
        error=error,
    )


_STATES = ("running", "done", "crashed")


def handwritten_digest(raw: bytes) -> list[Activity]:
    body = from_json(raw)
    if not isinstance(body, dict) or body.get("version") != 1:
        raise Bad("digest.version must be 1")
    node = body.get("node")
    if not isinstance(node, str) or not node or len(node) > MAX_HOST + 6 or not node.isprintable():
        raise Bad("digest.node")
    layout = _layout(body.get("layout"), "digest.layout")
    raw_rows = body.get("rows")
    if not isinstance(raw_rows, list) or len(raw_rows) > layout.world:
        raise Bad("digest.rows")
    rows, seen, fields = [], set(), ROW_FIELDS
    for i, r in enumerate(raw_rows):
        if not isinstance(r, list) or not len(fields) - 2 <= len(r) <= len(fields):
            raise Bad(f"digest.rows[{i}] must be a list")
        a = _row(dict(zip(fields, r)), layout, f"digest.rows[{i}]", (*_STATES, "gone", "silent"))
        if a.rank in seen:
            raise Bad(f"digest.rows[{i}]: rank {a.rank} appears twice")
        seen.add(a.rank)
        rows.append(a)
    return rows


def handwritten_activity(raw: bytes) -> Activity:
    body = from_json(raw)
    if not isinstance(body, dict) or body.get("version") != 1:
        raise Bad("version")
    report = body.get("activity")
    if not isinstance(report, dict):
        raise Bad("activity")
    layout = _layout([report.get("tp"), report.get("pp"), report.get("dp")], "activity [tp, pp, dp]")
    values = dict(report)
    values.setdefault("state", "running")
    values["host"] = values.get("host") or ""
    return _row(values, layout, "activity", _STATES)


DECODERS = {
    "msgspec Structs": (msgspec_digest, msgspec_activity),
    "pydantic models": (pydantic_digest, pydantic_activity),
    "hand-written": (handwritten_digest, handwritten_activity),
}


def per_decode_us(fn, raw: bytes, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(100):
            fn(raw)
        n += 100
    return elapsed / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="length of one timed loop")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wire_decode.json"))
    args = p.parse_args()
    digest, activity = bodies()
    expected = handwritten_digest(digest), handwritten_activity(activity)
    for name, (dec_digest, dec_activity) in DECODERS.items():  # the same rows from every decoder
        assert (dec_digest(digest), dec_activity(activity)) == expected, name
    before = cpu_jiffies()
    figures: dict[str, dict[str, list[float]]] = {name: {"digest": [], "activity": []} for name in DECODERS}
    for _ in range(args.runs):  # interleaved, so a noisy moment hits every decoder alike
        for name, (dec_digest, dec_activity) in DECODERS.items():
            figures[name]["digest"].append(per_decode_us(dec_digest, digest, args.seconds))
            figures[name]["activity"].append(per_decode_us(dec_activity, activity, args.seconds))
    stolen = stolen_share(before, cpu_jiffies())
    print(f"us per decode + validation; {RANKS}-rank digest {len(digest)} B, activity post {len(activity)} B")
    print(f"{args.runs} runs of {args.seconds:g} s each; CPU stolen by the host: {stolen:.1%}\n")
    rows = []
    for name, f in figures.items():
        rows.append(
            [
                name,
                " / ".join(f"{x:.1f}" for x in f["digest"]),
                statistics.median(f["digest"]),
                " / ".join(f"{x:.2f}" for x in f["activity"]),
                statistics.median(f["activity"]),
            ]
        )
    print_table(["decoder", "digest us (runs)", "median", "activity us (runs)", "median"], rows)
    write_json(
        args.out,
        {
            "ranks": RANKS,
            "digest_bytes": len(digest),
            "activity_bytes": len(activity),
            "seconds_per_run": args.seconds,
            "stolen_cpu_share": stolen,
            "us_per_decode": figures,
        },
    )


if __name__ == "__main__":
    main()
