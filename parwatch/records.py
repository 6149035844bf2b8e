"""Typed wire records of live activity (msgspec): a rank's report to its node sidecar and a node's
digest to the run's leader. The collector and the node sidecar encode these types; the sidecar
decodes them in one call that checks every field and bound (`decode`), and the OpenAPI document is
generated from them. What a type cannot say, because it depends on the run (a rank inside this run's
[tp, pp, dp], a node's rows within its world), the sidecar checks after decoding (sidecar/digest.py).

POST /v1/activity  ActivityPost: {"version": 1, "activity": ActivityReport}, ~300 bytes a second a rank.
POST /v1/digest    NodeDigest: {"version": 1, "node", "run_id", "time", "layout": [tp, pp, dp],
                   "order", "rows": [Activity as an array, ...]}, one a second per node. Its reply may carry
                   {"signal": [pid, ...]}: the leader asks that node to signal its culprit for a stack dump.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from parwatch.rank_layout import DEFAULT_ORDER, ORDERS
from parwatch.schema import MAX_ERROR_CHARS, MAX_TIME
from parwatch.vocabulary import (
    Action,
    CollectiveOp,
    DecisionSource,
    GroupRole,
    OutcomeName,
    RankState,
    RuleAction,
    SpanKind,
    StepAction,
    TimeCategory,
    Triage,
    jsonable,
)

# Bounds on what a report may claim. Every loop the leader runs over a run's ranks is bounded by the
# layout, so the layout is bounded (MAX_WORLD, above the largest runs published) and fixed per run at
# first contact; every other number is bounded by what a real run can have.
MAX_WORLD = 1 << 17
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_STEP = (1 << 31) - 1
MAX_SEQ = 1 << 53
MAX_STEP_SECONDS = 1e7
MAX_TEXT = 64  # kind, op, group
MAX_HOST = 253  # a DNS name
MAX_NODE = MAX_HOST + 6  # host:port
MAX_RUN_ID = 128
CONTROL_CHARS = r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"
"""Text that reaches logs and labels has none of these (the summaries' text too, parwatch/step_records.py)."""


_PRINTABLE = "^[^" + CONTROL_CHARS[1:-1] + "]*"
_PYTHON_END, _ECMA_END = r"\Z", "$"
"""Python's re (msgspec checks with it) also matches $ before a final newline; the schema's ECMA regex has no \\Z."""


def text(max_length: int, min_length: int = 0, description: str | None = None) -> Meta:
    """A printable string: no control characters (they would forge log lines and break labels)."""
    return Meta(min_length=min_length, max_length=max_length, pattern=_PRINTABLE + _PYTHON_END, description=description)


Rank = Annotated[int, Meta(ge=0, lt=MAX_WORLD)]
Parallel = Annotated[int, Meta(ge=1, le=MAX_WORLD, description="tp, pp or dp: at least 1")]
Pid = Annotated[int, Meta(ge=0, le=MAX_PID)]
Step = Annotated[int, Meta(ge=-1, le=MAX_STEP, description="the last completed step (-1 before the first)")]
Seq = Annotated[int, Meta(ge=0, le=MAX_SEQ)]
Time = Annotated[float, Meta(ge=0.0, le=MAX_TIME, description="unix seconds")]
StepSeconds = Annotated[float, Meta(ge=0.0, le=MAX_STEP_SECONDS)]
Text = Annotated[str, text(MAX_TEXT)]
Host = Annotated[str, text(MAX_HOST)]
RunId = Annotated[str, text(MAX_RUN_ID)]
Error = Annotated[str, text(MAX_ERROR_CHARS, description="crashed: 'ExceptionType: message'")]
Order = Annotated[
    str,
    Meta(
        pattern="^(" + "|".join(ORDERS) + ")" + _PYTHON_END,
        description="the run's rank order, fastest dimension first (parwatch.rank_layout); absent: tp-pp-dp",
    ),
]
Busy = Literal["checkpoint", "eval"]
"""Declared long activities: spans a rank may stay in for many step times without being stalled."""
MAX_PEERS_SENT = 64
Sent = Annotated[list[tuple[Rank, Seq]], Meta(max_length=MAX_PEERS_SENT)]
ReportState = Literal["running", "done", "crashed"]
RowState = Literal["running", "done", "crashed", "gone", "silent"]
"""A digest row's state adds what the node judged: gone (its pid ended), silent (alive, no reports)."""
STATES = {"activity": get_args(ReportState), "digest": get_args(RowState)}
if (STATES["activity"], STATES["digest"]) != (tuple(RankState)[:3], tuple(RankState)[:5]):
    raise ImportError("parwatch/records.py: a state differs from parwatch.vocabulary.RankState")
BUSY_KINDS = get_args(Busy)
if BUSY_KINDS != (SpanKind.CHECKPOINT, SpanKind.EVAL):
    raise ImportError("parwatch/records.py: Busy differs from parwatch.vocabulary.SpanKind's long activities")


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
    seq: Seq | None  # the collective's number on its group
    since: Time | None  # when the span opened (the rank's wall clock)
    step: Step
    step_seconds: StepSeconds | None
    pid: Pid
    host: Host
    stage: Rank
    tp_rank: Rank
    dp_rank: Rank
    time: Time  # when the rank sampled it
    step_end: Time | None  # when the rank ended `step` (null before its first): the leader times a stall from there
    error: Error | None = None  # crashed: the exception it ended with
    ended: Time | None = None  # gone: when its node saw the process end (exact, parwatch.sidecar.exits), else null
    busy: Busy | None = None  # inside a declared long activity (a checkpoint save, an eval pass): not stalled
    busy_since: Time | None = None  # when it began (the rank's wall clock)
    sent: Sent | None = (
        None  # [[peer, sends posted to it], ...]: a receive numbered k whose send k is posted is answered
    )
    device_since: Time | None = None  # CUDA: the device has not passed one piece of work since then (event queries)
    device_kind: Text | None = None  # the span kind of that work


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
    state: ReportState = "running"
    step: Step
    step_seconds: StepSeconds | None = None
    kind: Text | None = None
    op: Text | None = None
    group: Text | None = None
    peer: Rank | None = None
    seq: Seq | None = None
    since: Time | None = None
    time: Time
    step_end: Time | None = None
    error: Error | None = None
    busy: Busy | None = None
    busy_since: Time | None = None
    sent: Sent | None = None
    device_since: Time | None = None
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


MAX_EVIDENCE_SPANS = 64
MAX_STACK_CHARS = 128 * 1024


class SpanRow(Struct, array_like=True, frozen=True):
    """One of a rank's last spans, as its evidence keeps it: [kind, op, group, peer, seq, stage, microbatch,
    start, end] (start and end on the rank's wall clock; end null while it is open)."""

    kind: Text
    op: Text | None
    group: Text | None
    peer: Rank | None
    seq: Seq | None
    stage: Rank | None
    microbatch: Annotated[int, Meta(ge=0, le=MAX_STEP)] | None
    start: Time | None
    end: Time | None


class FlightRecorder(Struct, kw_only=True):
    """torch.distributed's Flight Recorder dump (NCCL, and gloo on torch >= 2.8), written by the rank."""

    path: Annotated[str, text(4096)] | None = None
    """Where the rank wrote the pickled dump (its run directory, else its temp directory); None: not written."""
    entries: Annotated[int, Meta(ge=0)] | None = None
    error: Annotated[str, text(MAX_ERROR_CHARS)] | None = None
    """Why there is no dump (no process group, no recorder in this torch, the buffer size is 0)."""


class RankEvidence(Struct, kw_only=True):
    """What one rank was doing when the leader named a hang or a crash (parwatch.collector.evidence)."""

    run_id: RunId | None = None
    decision: Annotated[int, Meta(ge=0, le=MAX_SEQ)]
    """The decision (its id in decisions.jsonl) this evidence was asked for."""
    rank: Rank
    time: Time
    activity: ActivityReport
    stacks: Annotated[str, Meta(max_length=MAX_STACK_CHARS)]
    """Every thread's Python stack, innermost call last (as faulthandler and traceback print them)."""
    spans: Annotated[list[SpanRow], Meta(max_length=MAX_EVIDENCE_SPANS)]
    """Its last spans, oldest first; the open ones (innermost last) at the end."""
    flight_recorder: FlightRecorder | None = None


class EvidencePost(Struct):
    """POST /v1/evidence: a rank's evidence to its node sidecar, or a node's to the leader."""

    version: Literal[1]
    evidence: RankEvidence


class NodeDigest(Struct):
    """POST /v1/digest: a node sidecar's ranks, their liveness judged on the node."""

    version: Literal[1]
    node: Annotated[str, text(MAX_NODE, min_length=1, description="the sending node sidecar's name")]
    run_id: RunId | None
    time: Time
    layout: tuple[Parallel, Parallel, Parallel]
    rows: Annotated[list[Activity], Meta(max_length=MAX_WORLD)]
    order: Order = DEFAULT_ORDER
    """The layout's rank order (an older node's digest has none: the default)."""


# --- the decision log (decisions.jsonl, GET /v1/decisions): what the guardrail engine decided and what came of it

DecisionAction = Annotated[
    str,
    Meta(
        pattern="^(" + "|".join(sorted(set(RuleAction) | set(Action) | set(StepAction))) + ")$",
        description="a rule's, a directive's or the check before the optimizer step's action",
    ),
]


class Decision(Struct, kw_only=True):
    """A decision: a rule's, an operator's, Alertmanager's, the engine's own or rank 0's. Enforced, a
    pause or rollback became directive `directive_id`. The fields at the end appear only where they apply."""

    type: Literal["decision"] = "decision"
    id: int = 0
    """Numbered by the engine, in the order decided."""
    run_id: str | None = None
    time: float
    step: int | None
    """The run's last evaluated step when decided (None: none yet, or since a rollback)."""
    rule: str | None = None
    action: DecisionAction
    source: DecisionSource
    requested_by: str = ""
    enforced: bool = False
    reason: str
    evidence: dict[str, Any]
    checkpoint: int | None = None
    """A rollback's target step."""
    skip_batches: int = 0
    directive_id: int | None = None
    escalated: bool = False
    """The engine chose a stronger action than asked (a pause for a rollback that would not help)."""
    finding: str | UnsetType = UNSET
    """"no_data": the rule's metric went quiet."""
    rearmed: bool | UnsetType = UNSET
    rearmed_by: int | UnsetType = UNSET
    """The operator's decision that re-armed this firing rule."""
    rearmed_rules: list[str] | UnsetType = UNSET
    """A resume's: the still-firing rules it re-armed."""
    alert_rule: str | UnsetType = UNSET
    """An Alertmanager request's: the parwatch rule the alert mirrors."""
    failed_directive_id: int | UnsetType = UNSET
    local: bool | UnsetType = UNSET
    """Decided by rank 0 itself while its sidecar was unreachable."""
    renumbered: dict[int, int] | UnsetType = UNSET
    """Directives rank 0 never took, given new ids above its own: {old: new}."""
    triage: Triage | UnsetType = UNSET
    """The check before the optimizer step's: what kind of fault the step was (source step_check)."""
    ranks: list[int] | UnsetType = UNSET
    """The check's: the ranks that produced the fault (with their hosts in evidence.hosts, where known)."""
    batch: int | None | UnsetType = UNSET
    """The check's: the batch (data step) the bad step trained on; a skip passes it over."""
    timeline: int | UnsetType = UNSET
    """The check's: the run's rollbacks before the step (its step number may repeat after one)."""


class Cancelled(Struct, kw_only=True):
    """An operator withdrew directive `directive_id` before it was delivered."""

    type: Literal["cancelled"] = "cancelled"
    directive_id: int
    action: DecisionAction
    decision_id: int | None
    time: float
    requested_by: str = ""
    step: int | None
    rearmed_rules: list[str] | UnsetType = UNSET


class Outcome(Struct, kw_only=True):
    """What the run's ranks did with a directive (type: their outcome, or mixed), one record per directive."""

    type: OutcomeName
    directive_id: int
    action: DecisionAction | None
    """None: a directive this engine does not know (cancelled long ago, or another sidecar's)."""
    decision_id: int | None
    step: int | None
    time: float
    ranks: str
    """The ranks that reported, as "0-N" ("" for none)."""
    rank_count: int
    counts: dict[str, int]
    """Outcome -> ranks."""
    requested_step: int | None | UnsetType = UNSET
    loaded_step: int | None | UnsetType = UNSET
    substituted: bool | UnsetType = UNSET
    reasons: dict[str, int] | UnsetType = UNSET
    note: str | UnsetType = UNSET


class Delivered(Struct, kw_only=True):
    """Directive `directive_id` went out to the run (in a reply to rank 0's post): from then on it cannot
    be cancelled. Logged so that a state recovered from the log alone knows it too."""

    type: Literal["delivered"] = "delivered"
    directive_id: int
    decision_id: int | None
    time: float
    step: int | None


LOG_TYPES = (Decision, Cancelled, Outcome, Delivered)
LOG_RECORDS: dict[str, type[Decision] | type[Cancelled] | type[Outcome] | type[Delivered]] = {
    "decision": Decision,
    "cancelled": Cancelled,
    "delivered": Delivered,
    **dict.fromkeys(OutcomeName, Outcome),
}
"""A decision log record's `type` -> its record."""


def log_record(record: Decision | Cancelled | Outcome | Delivered) -> dict[str, Any]:
    """A decision log record as the log and the API write it: JSON-safe (a non-finite number as a string)."""
    return jsonable(msgspec.to_builtins(record))


def check_log_record(record: dict) -> None:
    """BadRecord naming the field unless `record` (a decoded decisions.jsonl line) is a decision log record."""
    kind = record.get("type", "decision")
    typ = LOG_RECORDS.get(kind)
    if typ is None:
        raise BadRecord(f"unknown record type {kind!r}; one of {', '.join(LOG_RECORDS)}")
    parse({"type": kind, **record}, typ, kind)


class BadRecord(ValueError):
    """A body that does not decode into its record; the message names the field and the bound."""


T = TypeVar("T")
_decoders: dict[Any, msgspec.json.Decoder] = {}


TOO_DEEP = "body nests arrays or objects deeper than any record does (hundreds of levels): refused"


def decode(raw: bytes, record: type[T], root: str = "", *, dotted: bool = False) -> T:
    """Raw JSON -> `record`, every field checked; BadRecord names the field as `root`.field[.field...]
    (`dotted`: list items as .N, not [N])."""
    decoder = _decoders.get(record) or _decoders.setdefault(record, msgspec.json.Decoder(record))
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as err:
        try:  # the decoder stops at the first wrong field: broken JSON after it is the first thing to fix
            msgspec.json.decode(raw)
        except msgspec.DecodeError as broken:
            if not str(broken).startswith("Number out of range"):  # JSON, but past a float: the field's error says it
                raise BadRecord(f"body is not valid JSON: {broken}") from None
        except RecursionError:
            raise BadRecord(TOO_DEEP) from None
        raise BadRecord(where(str(err), root, dotted=dotted)) from None
    except msgspec.DecodeError as err:
        raise BadRecord(f"body is not valid JSON: {err}") from None
    except RecursionError:  # no record nests deeply; msgspec's decoder would stack past Python's limit
        raise BadRecord(TOO_DEEP) from None


def parse(value: Any, record: type[T], root: str = "", *, dotted: bool = False) -> T:
    """Python values (a decoded JSON line, a test's dict) -> `record`, checked as `decode` checks raw JSON."""
    try:
        return msgspec.convert(value, record)
    except msgspec.ValidationError as err:
        raise BadRecord(where(str(err), root, dotted=dotted)) from None
    except RecursionError:
        raise BadRecord(TOO_DEEP) from None


_ROW_FIELD = re.compile(r"(\.rows\[\d+\])\[(\d+)\]")
_ROW = re.compile(r"\.rows\[\d+\]")


def where(message: str, root: str, *, dotted: bool = False) -> str:
    """msgspec's 'Expected ... - at `$.rows[0][10]`' -> 'digest.rows[0].pid: Expected ...' (a row's array
    index read as its field name). A check of several fields (__post_init__) names its field first."""
    text, at, path = message.rpartition(" - at `")
    if not at:
        text, path = message, ""
    key = path.startswith(_KEY_IN)  # a dict's key, not a value: "... - at `key` in `$.a.b`"
    path = path.removeprefix(_KEY_IN).rstrip("`").removeprefix("$")
    if key:
        text = f"a key: {text}"
    if m := _ROW_FIELD.fullmatch(path):
        path = f"{m[1]}.{ROW_FIELDS[int(m[2])]}"
    elif _ROW.fullmatch(path):
        text += f" (a row is [{', '.join(ROW_FIELDS)}], the last {len(Activity.__struct_defaults__)} optional)"
    if m := _FIELD_FIRST.match(text):
        path, text = f"{path}.{m[1]}", text[m.end() :]
    elif m := _MISSING.fullmatch(text):
        path, text = f"{path}.{m[1]}", "required, but missing"
    elif m := _UNKNOWN.fullmatch(text):
        path, text = f"{path}.{m[1]}", "not a field of this body (a typo?)"
    if dotted:
        path = _INDEX.sub(r".\1", path)
    text = text.replace(f"matching regex {_PRINTABLE + _PYTHON_END!r}", "without control characters")
    name = path.rpartition(".")[2]
    choices = STATES[root or "activity"] if name == "state" else _CHOICES.get(name)
    if "Invalid enum value" in text and choices:
        text += f" (one of {', '.join(choices)})"
    return f"{(root + path).lstrip('.') or 'body'}: {text}"


_FIELD_FIRST = re.compile(r"([a-z_]+): ")
_MISSING = re.compile(r"Object missing required field `(\w+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(\w+)`")
_INDEX = re.compile(r"\[(\d+)\]")
_KEY_IN = "key` in `"
_CHOICES: dict[str, tuple[str, ...]] = {
    "action": tuple(Action),
    "op": tuple(CollectiveOp),
    "group": tuple(GroupRole),
    "groups": tuple(GroupRole),
    "outcome": tuple(OutcomeName),
    "counts": tuple(OutcomeName),
    "time_seconds": tuple(TimeCategory),
}
"""Closed sets whose members an error lists (a state's depend on the record: STATES)."""


def encode(record: Struct) -> bytes:
    return msgspec.json.encode(record)


def openapi_schemas(types: tuple[type, ...]) -> dict[str, Any]:
    """The JSON schemas of `types` and the records they hold, named as their classes, for the OpenAPI document."""
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    return _ecma(components)


def openapi_components() -> dict[str, Any]:
    """The activity posts' and the decision log's records."""
    return openapi_schemas((ActivityPost, NodeDigest, EvidencePost, *LOG_TYPES))


def _ecma(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: v.removesuffix(_PYTHON_END) + _ECMA_END if k == "pattern" and v.endswith(_PYTHON_END) else _ecma(v)
            for k, v in schema.items()
        }
    return [_ecma(v) for v in schema] if isinstance(schema, list) else schema
