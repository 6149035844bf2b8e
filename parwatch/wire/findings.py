"""A decision's evidence, typed: what the hang monitor (parwatch.sidecar.hang), a rule (parwatch.guardrails.checks),
the requeuer and an operator's request saw. The producers build these records; the decision log writes them as
JSON objects in field order (a field left UNSET is left out), so Decision.evidence reads back as a dict, and
`finding_evidence` types it again by the decision's rule and source. A check's before the optimizer step and
rank 0's own decision keep the dicts the ranks sent (their shape is the contract's, parwatch.contract)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from parwatch.vocabulary import (
    BuiltinRule,
    CheckKind,
    Comparison,
    DecisionSource,
    HangKind,
    Outcome,
    RankState,
    Reduce,
    SpanKind,
)
from parwatch.wire.activity import Activity, Busy

NO_DATA = "no-data"
"""A decision's `finding` when its rule's metric went quiet."""
REGRESSION_VALUES = "ratios of each series to its own baseline median"


class Culprit(Struct, kw_only=True):
    """The named rank's activity row, as a hang or rank-gone finding shows it."""

    rank: int
    """Its global rank."""
    state: RankState
    """Its row's state (running; crashed or gone for a rank-gone)."""
    stage: int
    """Its pipeline stage."""
    tp_rank: int
    """Its tensor-parallel rank."""
    dp_rank: int
    """Its data-parallel rank."""
    host: str
    """The host its process runs on."""
    pid: int
    """Its process id on that host."""
    kind: str | None
    """Its open span's kind (None: between spans)."""
    op: str | None
    """The open span's op (a collective's or a send's)."""
    group: str | None
    """The process group the open span names."""
    peer: int | None
    """A send's or receive's other end."""
    seq: int | None
    """The collective's number on its group."""
    since: float | None
    """When the open span began (the rank's wall clock)."""
    step: int
    """Its last completed step."""
    ended: float | None
    """When its node saw its process end (None: not seen)."""
    error: str | None | UnsetType = UNSET
    """A crashed rank's exception (a rank-gone's culprit that crashed)."""

    @classmethod
    def of(cls, a: Activity, error: str | None | UnsetType = UNSET) -> Culprit:
        """Rank `a`'s row (with the error it crashed of, where given): every field but the error is its namesake."""
        return cls(**{name: getattr(a, name) for name in cls.__struct_fields__[:-1]}, error=error)


class PointsAt(Struct, kw_only=True):
    """A rank the waits point at that the leader has no current report of (so no culprit is named)."""

    rank: int
    """The rank the waits end at."""
    seen: bool
    """Whether the leader has a current report of it (always False: else it is the culprit)."""


class Missing(Struct, kw_only=True):
    """What the culprit has not joined: a collective the others are in, or a peer's send or receive."""

    kind: SpanKind
    """collective, or the waiting rank's recv or send."""
    op: str | UnsetType = UNSET
    """The collective's op."""
    group: str | UnsetType = UNSET
    """The collective's group."""
    seq: int | None | UnsetType = UNSET
    """The collective's number on its group (None: the step boundary's, numbered by step)."""
    by: int | UnsetType = UNSET
    """The rank waiting in the send or receive."""


class NodeMissing(Struct, kw_only=True):
    """A node whose sidecar's digests stopped."""

    node: str
    """The node sidecar's name (host:port)."""
    since: float
    """When its last digest reached the leader (the leader's clock)."""


class Coverage(Struct, kw_only=True):
    """What the leader sees of the run when it judges."""

    ranks_seen: int
    """Ranks with a current report."""
    world: int
    """The run's ranks."""
    nodes_missing: list[NodeMissing]
    """Nodes whose digests stopped (the first 16)."""
    ranks_never_seen: list[int]
    """Ranks that never reported (the first 16)."""


class Requeue(Struct, kw_only=True):
    """The Slurm job a requeue restarts, and its budget (parwatch.sidecar.requeue)."""

    job_id: str | None
    """The Slurm job (None: not under Slurm)."""
    restarts: int | None
    """Times the job was restarted already (SLURM_RESTART_COUNT)."""
    max_requeues: int
    """The most restarts the leader asks for."""


class HangEvidence(Struct, kw_only=True):
    """A hang: no step boundary past the bound, the culprit the waits point at and who waits for it."""

    culprit: Culprit | None
    """The rank the others wait for (None: one the leader has no current report of: points_at)."""
    points_at: PointsAt | None
    """The rank the waits point at when no culprit is named."""
    kind: HangKind | None
    """What the culprit is stuck in (None: no culprit seen)."""
    kind_waits_on: list[int]
    """The ranks the culprit itself waits on (a peer or transport stall's)."""
    waiting: list[int]
    """The ranks that wait for it, transitively (the first 64)."""
    waiting_count: int
    """All the ranks that wait for it."""
    waits_on: dict[int, list[int]]
    """A waiting rank -> the ranks it waits for directly (the first 64 waiting ranks)."""
    missing: Missing | None
    """What the culprit has not joined (None: nothing waits for it by name)."""
    method: Literal["dependency", "oldest-span"]
    """How it was found: the waits' graph, or the oldest open span when nobody waits for anybody."""
    stalled_seconds: float
    """The stall the bound judged."""
    since_boundary_seconds: float
    """Since the last step boundary, busy time included."""
    busy: Busy | None
    """The declared long activity the culprit is in past its bound (checkpoint, eval)."""
    stalled_since: float | None
    """When the last step boundary ended (the leader's clock)."""
    bound_seconds: float
    """The hang bound judged against."""
    median_step_seconds: float | None
    """The median step time the bound scales (None: no step yet)."""
    last_step: int
    """The step of the last boundary."""
    stale_ranks: int
    """Running ranks whose report predates the stall (judged with what there was)."""
    coverage: Coverage | None
    """What the leader saw."""
    cpu_wait_seconds: float | None = None
    """Of the stall judged, the seconds the culprit waited for a CPU, not counted against the bound (None: its
    node could not tell)."""
    requeue: Requeue | UnsetType = UNSET
    """The Slurm job's requeue budget (the leader requeues on a hang)."""
    bundle: str | UnsetType = UNSET
    """Where the ranks' evidence is kept, relative to the state dir."""


class RankGoneEvidence(Struct, kw_only=True):
    """A rank's process ended (crashed, killed), its echoes, or a node lost whole."""

    culprit: Culprit | None
    """The first rank to fail (None: echoes of a failure named before, or a cause among unseen ranks)."""
    cause: Literal["node-lost"] | UnsetType = UNSET
    """node-lost: a stall whose waits point at a node gone quiet, ranks and sidecar."""
    echo_of: int | UnsetType = UNSET
    """The rank whose failure, named before, these ranks echo."""
    points_at: PointsAt | UnsetType = UNSET
    """The rank the waits point at, unseen."""
    gone: list[int]
    """The ranks gone (the culprit first)."""
    unseen: list[int] | UnsetType = UNSET
    """Ranks with no current report, among which the first failure is (the first 64)."""
    nodes_lost: list[NodeMissing] | UnsetType = UNSET
    """The nodes gone quiet (node-lost)."""
    stalled_seconds: float | UnsetType = UNSET
    """node-lost: the stall when judged."""
    stalled_since: float | None | UnsetType = UNSET
    """node-lost: when the last step boundary ended (the leader's clock)."""
    coverage: Coverage | None
    """What the leader saw."""
    bundle: str | UnsetType = UNSET
    """Where the ranks' evidence is kept, relative to the state dir (not for echoes)."""


class SidecarLostEvidence(Struct, kw_only=True):
    """A node's sidecar sent no digest while the run crossed step boundaries: its ranks train on, unseen."""

    node: str
    """The node sidecar's name (host:port)."""
    silent_since: float
    """When its last digest reached the leader."""
    ranks: list[int]
    """Its ranks, as its last digest named them (the first 64)."""
    last_step: int
    """The run's step when judged."""


class RuleEvidence(Struct, kw_only=True):
    """A rule's failing run (threshold, finite, spike, regression): its values and the line they crossed."""

    metric: str
    """The metric the rule reads."""
    check: CheckKind
    """The rule's check."""
    series: str | None
    """The series key that gave the judged value (None: a mean)."""
    reduce: Reduce
    """How the series became one value."""
    values: list[float]
    """The failing run's judged values, oldest first (the newest 200)."""
    values_series: list[str | None] | UnsetType = UNSET
    """The series key of each of `values`, when they were not all the same one (`series` is the one that
    gave most of them)."""
    for_steps: int
    """Failing evaluations the rule needs to fire."""
    window: tuple[int | None, int | None]
    """The failing run's first and last step."""
    stage: int | UnsetType = UNSET
    """The stage the series key names."""
    culprit: dict[str, int | str | list[int]] | UnsetType = UNSET
    """Every label of the series key (stage, rank, host, link, group, cause ...)."""
    for_seconds: float | UnsetType = UNSET
    """How long the rule needs to fail to fire."""
    threshold: float | UnsetType = UNSET
    """threshold: the line."""
    comparison: Comparison | UnsetType = UNSET
    """threshold: which side of the line fails."""
    factor: float | None | UnsetType = UNSET
    """spike, regression: the factor of the baseline that fails."""
    baseline: float | None | UnsetType = UNSET
    """spike, regression: the median the factor multiplies."""
    window_steps: int | None | UnsetType = UNSET
    """spike, regression: the values the baseline is the median of."""
    min_increase: float | UnsetType = UNSET
    """regression: how far above its median a series had to be as well (the rule's min_increase)."""
    values_are: str | UnsetType = UNSET
    """regression: what `values` are (ratios to each series' own baseline)."""


class NoDataEvidence(Struct, kw_only=True):
    """A rule's metric went quiet past its no_data_seconds."""

    metric: str
    """The metric the rule reads."""
    last_seen_time: float | None
    """When it was last reported (None: never)."""
    no_data_seconds: float | None
    """The silence the rule allows."""


class RequeueNote(Struct, kw_only=True):
    """A requeue not carried out (refused by its budget, or scontrol failed): the alert's evidence."""

    requeue_decision: int | None
    """The decision whose requeue it was."""
    job_id: str | None
    """The Slurm job (None: not under Slurm)."""
    restarts: int | None
    """Times the job was restarted already."""
    max_requeues: int
    """The most restarts the leader asks for."""


class RequestEvidence(Struct, kw_only=True):
    """An operator's or Alertmanager's pause, resume or rollback."""

    to_step: int | None
    """A rollback's checkpoint."""
    skip_batches: int
    """A rollback's batches to skip."""


class RollbackFailedEvidence(Struct, kw_only=True):
    """A rollback the ranks failed (the engine pauses the run and alerts)."""

    directive_id: int
    """The rollback's directive."""
    outcome: Outcome
    """failed, or mixed."""
    reasons: dict[str, int]
    """FailReason -> ranks."""


Finding = (
    HangEvidence
    | RankGoneEvidence
    | SidecarLostEvidence
    | RuleEvidence
    | NoDataEvidence
    | RequeueNote
    | RequestEvidence
    | RollbackFailedEvidence
)
BUILTIN: dict[str, type[Finding]] = {
    BuiltinRule.HANG: HangEvidence,
    BuiltinRule.RANK_GONE: RankGoneEvidence,
    BuiltinRule.SIDECAR_LOST: SidecarLostEvidence,
}
"""The hang monitor's rules -> their evidence."""


def evidence_type(record: Mapping[str, Any]) -> type[Finding] | None:
    """The record a decision's evidence is, by its rule and source (None: a dict the ranks sent)."""
    source, evidence = record.get("source"), record.get("evidence")
    if isinstance(evidence, dict) and "requeue_decision" in evidence:
        return RequeueNote  # the rule is the requeued decision's
    if record.get("rule") in BUILTIN:
        return BUILTIN[record["rule"]]
    if source == DecisionSource.RULE:
        return NoDataEvidence if record.get("finding") == NO_DATA else RuleEvidence
    if source in (DecisionSource.OPERATOR, DecisionSource.ALERTMANAGER):
        return RequestEvidence
    if source == DecisionSource.ENGINE:
        return RollbackFailedEvidence
    return None


def finding_evidence(record: Mapping[str, Any]) -> Finding | None:
    """A decision record's evidence (as logged, or decoded from a line or an answer) typed again; None when
    it is a dict the ranks sent, or of another shape (an older sidecar's)."""
    kind = evidence_type(record)
    if kind is None:
        return None
    try:
        typed: Finding = msgspec.convert(record.get("evidence"), kind, strict=False)
    except msgspec.ValidationError:
        return None
    return typed


def bundle_of(record: Mapping[str, Any]) -> str | None:
    """Where a hang's or rank-gone's ranks' evidence is kept (relative to the state dir); None elsewhere."""
    evidence = finding_evidence(record) if record.get("rule") in BUILTIN else None
    if isinstance(evidence, (HangEvidence, RankGoneEvidence)) and isinstance(evidence.bundle, str):
        return evidence.bundle
    return None
