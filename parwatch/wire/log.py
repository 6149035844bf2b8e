"""The decision log on the wire (decisions.jsonl, GET /v1/decisions): what the guardrail engine decided
and what came of it.

A line is one record of a union tagged by its `type`: a decision, a directive cancelled or delivered, or
what the run's ranks did with a directive, whose type is their outcome (applied, substituted, failed,
ignored; mixed when they differ). A line without a `type` is a decision (the log's first lines had none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, get_args

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from parwatch.vocabulary import (
    Action,
    DecisionSource,
    Outcome,
    RecordType,
    RuleAction,
    StepAction,
    Triage,
    jsonable,
)
from parwatch.wire.codec import BadRecord, parse

DecisionAction = Annotated[
    str,
    Meta(
        pattern="^(" + "|".join(sorted(set(RuleAction) | set(Action) | set(StepAction))) + ")$",
        description="a rule's, a directive's or the check before the optimizer step's action",
    ),
]

if TYPE_CHECKING:  # built as a finding's record (parwatch.wire.findings); read back, the object it was written as
    from parwatch.wire.findings import Finding

    Evidence = Finding | dict[str, Any]
else:
    Evidence = dict[str, Any]


class LogEntry(Struct, kw_only=True, tag_field="type"):
    """A decision log record: its class's tag is its `type`."""


class Decision(LogEntry, kw_only=True, tag=RecordType.DECISION.value):
    """A decision: a rule's, an operator's, Alertmanager's, the engine's own or rank 0's. Enforced, a
    pause or rollback became directive `directive_id`. The fields at the end appear only where they apply."""

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
    evidence: Evidence
    """What the decision saw: a record of parwatch.wire.findings, or the dict the ranks sent (a step check's)."""
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


class Cancelled(LogEntry, kw_only=True, tag=RecordType.CANCELLED.value):
    """An operator withdrew directive `directive_id` before it was delivered."""

    directive_id: int
    action: DecisionAction
    decision_id: int | None
    time: float
    requested_by: str = ""
    step: int | None
    rearmed_rules: list[str] | UnsetType = UNSET


class Delivered(LogEntry, kw_only=True, tag=RecordType.DELIVERED.value):
    """Directive `directive_id` went out to the run (in a reply to rank 0's post): from then on it cannot
    be cancelled. Logged so that a state recovered from the log alone knows it too."""

    directive_id: int
    decision_id: int | None
    time: float
    step: int | None


class Handled(LogEntry, kw_only=True):
    """What the run's ranks did with a directive, one record per directive; its type is their outcome."""

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


class Applied(Handled, tag=Outcome.APPLIED.value):
    pass


class Substituted(Handled, tag=Outcome.SUBSTITUTED.value):
    """A rollback loaded an older verified checkpoint than asked."""


class Failed(Handled, tag=Outcome.FAILED.value):
    pass


class Ignored(Handled, tag=Outcome.IGNORED.value):
    """Another run's directive."""


class Mixed(Handled, tag=Outcome.MIXED.value):
    """The ranks differ (counts says how)."""


LogRecord = Decision | Cancelled | Delivered | Applied | Substituted | Failed | Ignored | Mixed
LOG_TYPES: tuple[type[LogEntry], ...] = get_args(LogRecord)
HANDLED: dict[Outcome, type[Handled]] = {
    Outcome(str(c.__struct_config__.tag)): c for c in (Applied, Substituted, Failed, Ignored, Mixed)
}
"""An outcome -> the record of a directive the ranks handled so."""
TAGS = tuple(str(t.__struct_config__.tag) for t in LOG_TYPES)


def log_record(record: LogEntry) -> dict[str, Any]:
    """A decision log record as the log and the API write it: JSON-safe (a non-finite number as a string)."""
    written: dict[str, Any] = jsonable(msgspec.to_builtins(record))
    return written


def check_log_record(record: dict[str, Any]) -> None:
    """BadRecord naming the field unless `record` (a decoded decisions.jsonl line) is a decision log record."""
    kind = record.get("type", RecordType.DECISION)
    if kind not in TAGS:
        raise BadRecord(f"unknown record type {kind!r}; one of {', '.join(TAGS)}")
    parse({"type": kind, **record}, LogRecord, kind)  # type: ignore[arg-type]  # a union is a type msgspec takes
