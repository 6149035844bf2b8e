"""Live activity on the wire: a rank's report to its node sidecar and a node's digest to the run's leader.

POST /v1/activity  ActivityPost: {"version": 1, "activity": ActivityReport}, ~300 bytes a second a rank.
POST /v1/digest    NodeDigest: {"version": 1, "node", "run_id", "time", "layout": [tp, pp, dp],
                   "order", "rows": [Activity as an array, ...]}, one a second per node. Its reply may carry
                   {"signal": [pid, ...]}: the leader asks that node to signal its culprit for a stack dump.

What a type cannot say, because it depends on the run (a rank inside this run's [tp, pp, dp], a node's rows
within its world), the sidecar checks after decoding (sidecar/digest.py). Bounds: parwatch/wire/bounds.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, get_args

from msgspec import Meta, Struct

from parwatch.rank_layout import DEFAULT_ORDER
from parwatch.vocabulary import RankState, SpanKind
from parwatch.wire.bounds import (
    MAX_WORLD,
    Count,
    Error,
    Host,
    LastStep,
    Node,
    Order,
    Parallel,
    Pid,
    Rank,
    RunId,
    Seconds,
    Text,
    Timestamp,
)

HANG_EXIT_CODE = 75
"""Exit status of a rank the leader aborted for a hang (EX_TEMPFAIL): restart from the last checkpoint."""
if TYPE_CHECKING:  # mypy holds code to the members; msgspec decodes no Literal of enum members, so it reads words
    ReportState = Literal[RankState.RUNNING, RankState.DONE, RankState.CRASHED]
    RowState = Literal[RankState.RUNNING, RankState.DONE, RankState.CRASHED, RankState.GONE, RankState.SILENT]
else:
    ReportState = Literal["running", "done", "crashed"]
    RowState = Literal["running", "done", "crashed", "gone", "silent"]
"""A digest row's state adds what the node judged: gone (its pid ended), silent (alive, no reports)."""
STATES = {"activity": get_args(ReportState), "digest": get_args(RowState)}
if (STATES["activity"], STATES["digest"]) != (tuple(RankState)[:3], tuple(RankState)[:5]):
    raise ImportError("parwatch/wire/activity.py: a state differs from parwatch.vocabulary.RankState")
if TYPE_CHECKING:
    Busy = Literal[SpanKind.CHECKPOINT, SpanKind.EVAL]
else:
    Busy = Literal["checkpoint", "eval"]
"""Declared long activities: spans a rank may stay in for many step times without being stalled."""
BUSY_KINDS = get_args(Busy)
if BUSY_KINDS != (SpanKind.CHECKPOINT, SpanKind.EVAL):
    raise ImportError("parwatch/wire/activity.py: Busy differs from parwatch.vocabulary.SpanKind's long activities")
MAX_PEERS_SENT = 64
Sent = Annotated[list[tuple[Rank, Count]], Meta(max_length=MAX_PEERS_SENT)]


# gc=False: the leader holds a row per rank (16,384 at 16,384 ranks) and a row refers to no container,
# so it can form no cycle; untracked, the rows cost the garbage collector nothing (docs/benchmarks.md).
class Activity(Struct, array_like=True, frozen=True, gc=False):
    """One rank's latest activity: a node digest's row (an array, in this field order) and the leader's
    record. Elements past `error` are ignored: a newer node's fields."""

    rank: Rank
    state: RowState  # the leader adds `unknown` for a node gone quiet
    kind: Text | None  # the open span (null: between spans)
    op: Text | None
    group: Text | None
    peer: Rank | None
    seq: Count | None  # the collective's number on its group
    since: Timestamp | None  # when the span opened (the rank's wall clock)
    step: LastStep
    step_seconds: Seconds | None
    pid: Pid
    host: Host
    stage: Rank
    tp_rank: Rank
    dp_rank: Rank
    time: Timestamp  # when the rank sampled it
    step_end: (
        Timestamp | None
    )  # when the rank ended `step` (null before its first): the leader times a stall from there
    error: Error | None = None  # crashed: the exception it ended with
    ended: Timestamp | None = None  # gone: when its node saw the process end (exact, parwatch.sidecar.exits), else null
    busy: Busy | None = None  # inside a declared long activity (a checkpoint save, an eval pass): not stalled
    busy_since: Timestamp | None = None  # when it began (the rank's wall clock)
    sent: Sent | None = (
        None  # [[peer, sends posted to it], ...]: a receive numbered k whose send k is posted is answered
    )
    device_since: Timestamp | None = (
        None  # CUDA: the device has not passed one piece of work since then (event queries)
    )
    device_kind: Text | None = None  # the span kind of that work
    cpu_wait: Seconds | None = None  # how long it waited for a CPU since step_end (its node reads it: cpu_wait.py)
    span_cpu_wait: Seconds | None = None  # ... since the later of step_end and since (when it entered its span)


class ActivityReport(Struct, kw_only=True):
    """What a rank is doing now (parwatch.collector.activity): its open span, coordinates and last step."""

    run_id: RunId | None = None
    rank: Rank
    pid: Pid
    host: Host | None = None
    stage: Rank
    tp_rank: Rank
    dp_rank: Rank
    tp: Parallel
    pp: Parallel
    dp: Parallel
    order: Order | None = None
    """None: the default order (tp-pp-dp), as an older collector's report means."""
    state: ReportState = RankState.RUNNING
    step: LastStep
    step_seconds: Seconds | None = None
    kind: Text | None = None
    op: Text | None = None
    group: Text | None = None
    peer: Rank | None = None
    seq: Count | None = None
    since: Timestamp | None = None
    time: Timestamp
    step_end: Timestamp | None = None
    error: Error | None = None
    busy: Busy | None = None
    busy_since: Timestamp | None = None
    sent: Sent | None = None
    device_since: Timestamp | None = None
    device_kind: Text | None = None

    def row(self) -> Activity:
        """This report as its node's digest row (a missing host reads as "")."""
        values = {f: getattr(self, f) for f in ROW_FIELDS if f in ACTIVITY_FIELDS}
        values["host"] = self.host or ""
        return Activity(**values)


ACTIVITY_FIELDS = ActivityReport.__struct_fields__
ROW_FIELDS = Activity.__struct_fields__


class ActivityPost(Struct):
    """POST /v1/activity."""

    version: Literal[1]
    activity: ActivityReport


class NodeDigest(Struct):
    """POST /v1/digest: a node sidecar's ranks, their liveness judged on the node."""

    version: Literal[1]
    node: Node
    run_id: RunId | None
    time: Timestamp
    layout: tuple[Parallel, Parallel, Parallel]
    rows: Annotated[list[Activity], Meta(max_length=MAX_WORLD)]
    order: Order = DEFAULT_ORDER
    """The layout's rank order (an older node's digest has none: the default)."""
