"""Pydantic models mirroring parwatch/schema.py: what the control listener accepts.

Validation errors become 422s whose reason names the field (see app.py), so every
constraint here says what was expected. Every number is bounded by what its metric can
hold: counts are exported as float64 samples, so they stay float-exact (<= 2**53, well
inside int64); seconds and ratios are finite and bounded; strings that become label
values or log text are short and printable. Stored data therefore can never make a
/metrics scrape fail (tests/unit/test_sidecar_properties.py).
"""

from __future__ import annotations

import math
import operator
import re
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from parwatch import vocabulary
from parwatch.guardrails.engine import MAX_CHECKPOINTS
from parwatch.records import CONTROL_CHARS
from parwatch.schema import COLLECTIVE_BUCKETS, DIRECTIVE_ACTIONS, MAX_TIME, SCHEMA_VERSION, decode_float

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"]
CollectiveGroup = Literal["tp", "pp", "dp", "world", "ep", "cp"]
"""Process groups a collective may name (the `group` label): a closed list bounds the series."""
COLLECTIVE_OPS: tuple[str, ...] = get_args(CollectiveOp)
COLLECTIVE_GROUPS: tuple[str, ...] = get_args(CollectiveGroup)

# Written out for the type checker (Literal takes no variables); the values stay those of schema.py
# and parwatch.vocabulary.
SchemaVersion = Literal[1]
DirectiveAction = Literal["pause", "resume", "rollback"]
if (
    get_args(SchemaVersion) != (SCHEMA_VERSION,)
    or get_args(DirectiveAction) != DIRECTIVE_ACTIONS
    or COLLECTIVE_OPS != tuple(vocabulary.CollectiveOp)
    or COLLECTIVE_GROUPS != tuple(vocabulary.GroupRole)
):
    raise ImportError("sidecar/models.py: a Literal differs from parwatch.schema or parwatch.vocabulary")

MAX_COUNT = 2**53
"""Largest count accepted: exported as a float64 sample, so it must be float-exact (and fits int64)."""
MAX_SECONDS = 1e9
"""Largest duration accepted (about 31 years): finite, and a sum of many stays finite."""
MAX_RATIO = 1e6
MAX_PARALLEL = 1 << 20
"""Largest tp, pp, dp (and their product, the world) a summary may claim."""


def _finite_loss(x):
    """Loss may be a number, null, or one of the strings "nan", "inf", "-inf"; an integer too large
    for a float is refused rather than overflowing."""
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_COUNT:
        raise ValueError(f"{str(x)[:20]}... is too large; send the loss as a float (or 'inf')")
    return decode_float(x)


_CONTROL = re.compile(CONTROL_CHARS)


def _printable(x: str) -> str:
    """Label values and log text: no control characters, valid UTF-8 (no lone surrogates)."""
    if _CONTROL.search(x):
        raise ValueError("must not contain control characters")
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 (no lone surrogates)") from None
    return x


def _not_bool(x):
    """JSON true/false is not a number here (pydantic's lax mode would read it as 1/0).

    Integer fields say this with Field(strict=True) instead, which keeps their bounds checks in
    pydantic-core (a Python validator in front of the bounds would move them to Python too)."""
    if isinstance(x, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    return x


WireFloat = Annotated[float | None, BeforeValidator(_finite_loss)]
Finite = Annotated[float, Field(strict=True, ge=-MAX_RATIO, le=MAX_RATIO, allow_inf_nan=False)]
Ratio = Finite
Seconds = Annotated[float, Field(strict=True, ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
LedgerSeconds = Annotated[float, Field(strict=True, ge=0, le=MAX_SECONDS * 100, allow_inf_nan=False)]
"""A rank's cumulative seconds in one ledger category: up to ~3,000 years."""
SignedSeconds = Annotated[float, Field(strict=True, ge=-MAX_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)]
NonNegFinite = Annotated[float, Field(strict=True, ge=0, lt=MAX_COUNT, allow_inf_nan=False)]
"""Below 2**53, not up to it: an integer past it (2**53 + 1) rounds to 2**53 as a float and would pass `le`."""
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_COUNT)]
Index = Annotated[int, Field(strict=True, ge=0, lt=MAX_PARALLEL)]
Parallel = Annotated[int, Field(strict=True, ge=1, le=MAX_PARALLEL)]
Flag = Annotated[bool, Field(strict=True)]
"""true or false only (not 0/1 or "yes")."""
Text = Annotated[str, AfterValidator(_printable)]


class _Model(BaseModel):
    # Unknown keys are ignored so a newer collector can add fields without breaking an older sidecar.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Collective(_Model):
    op: CollectiveOp
    group: CollectiveGroup
    count: Count
    seconds: Seconds
    bytes: Count = 0
    buckets: list[Count] = Field(default_factory=list, max_length=len(COLLECTIVE_BUCKETS) + 1)
    algbw: NonNegFinite = 0.0
    busbw: NonNegFinite = 0.0

    @model_validator(mode="after")
    def _buckets_fit(self):
        n = len(COLLECTIVE_BUCKETS)
        if self.buckets:
            if len(self.buckets) not in (n, n + 1):
                raise ValueError(f"buckets has {len(self.buckets)} counts; expected {n} (one per le bound) or {n + 1}")
            # map() keeps the per-collective check in C: it runs for every collective of every post.
            if not all(map(operator.le, self.buckets, self.buckets[1:])) or self.buckets[-1] > self.count:
                raise ValueError("buckets must be cumulative (non-decreasing) and end at most at count")
        return self


class Gpu(_Model):
    index: Annotated[int, Field(strict=True, ge=0, le=1024)]
    utilization_ratio: Annotated[float, Field(strict=True, ge=0, le=1)] | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    power_watts: Annotated[float, Field(strict=True, ge=0, le=1e6, allow_inf_nan=False)] | None = None
    sm_clock_hertz: Annotated[float, Field(strict=True, ge=0, le=1e12, allow_inf_nan=False)] | None = None
    temperature_celsius: Annotated[float, Field(strict=True, ge=-300, le=1e4, allow_inf_nan=False)] | None = None
    throttle_reasons: Annotated[int, Field(strict=True, ge=0, lt=2**64)] | None = None  # NVML's bit mask


MaxStep = Annotated[int, Field(strict=True, ge=0, lt=2**53)]
RunId = Annotated[Text, Field(min_length=1, max_length=200)]
OutcomeName = Literal["applied", "substituted", "failed", "ignored", "mixed"]
OUTCOMES: tuple[str, ...] = get_args(OutcomeName)
SmallCount = Annotated[int, Field(strict=True, ge=0, le=2**31)]


Timestamp = Annotated[float, Field(strict=True, ge=0, le=MAX_TIME, allow_inf_nan=False)]


class LocalDecision(_Model):
    """A decision rank 0 made itself while its sidecar was unreachable (parwatch/collector/fallback.py),
    riding the outcome record of its directive: the leader records it and judges the loss."""

    rule: Literal["nonfinite-loss"]
    action: Literal["pause"]
    step: MaxStep
    """The step whose loss was non-finite."""
    loss: WireFloat = None
    time: Timestamp
    """When rank 0 decided (its wall clock)."""
    after: Annotated[int, Field(strict=True, ge=0, lt=2**53)] = 0
    """The last directive id the ranks handled before it: the leader's later ones were never taken."""
    checkpoints: list[MaxStep] = Field(default_factory=list, max_length=1000)
    """Rank 0's complete checkpoints then (a rollback target must be one)."""
    unreachable_since: Timestamp | None = None
    reason: Annotated[Text, Field(max_length=1000)] = ""


class OutcomeRecord(_Model):
    """Rank 0's report of what every rank did with one directive (counted in the boundary vector)."""

    directive_id: Annotated[int, Field(strict=True, gt=0, lt=2**53)]
    run_id: RunId
    outcome: OutcomeName
    step: MaxStep
    loaded_step: MaxStep | None = None
    counts: dict[OutcomeName, SmallCount] = Field(default_factory=dict)
    reasons: dict[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")], SmallCount] = Field(
        default_factory=dict, max_length=16
    )
    ranks: Annotated[int, Field(strict=True, ge=1, le=2**31)]
    local: LocalDecision | None = None
    """Set when rank 0 made this directive itself (its sidecar was unreachable)."""


SignedCount = Annotated[int, Field(strict=True, ge=-MAX_COUNT, le=MAX_COUNT)]
InstanceRecord = tuple[CollectiveOp, CollectiveGroup, Count, SignedCount, SignedCount, Count, Count]
"""[op, group, seq, peer, start_us, dur_us, bytes] (parwatch/collector/instances.py)."""


class Instances(_Model):
    """One rank-step's collective/p2p instance records and data seconds (schema.py `instances`)."""

    host: Annotated[Text, Field(max_length=255)] = ""
    data_seconds: Seconds = 0.0
    groups: dict[CollectiveGroup, Annotated[list[Count], Field(max_length=100_000)]] = Field(
        default_factory=dict, max_length=64
    )
    records: list[InstanceRecord] = Field(default_factory=list, max_length=20_000)
    capped: Count = 0


MAX_FORWARD_HALVES = 2000
"""Instances per cross-node post (a node posts once a second; ~150 bytes each as JSON)."""
MAX_FORWARD_RANK_ROWS = 4096
"""Rank attribution rows per cross-node post."""
MAX_NODE_RANKS = 4096
"""Members one node may report for one instance (a node runs a few to a few dozen ranks)."""
ForwardedMember = tuple[Index, CollectiveOp, Count, Count]
"""[rank, op on that rank, duration microseconds, bytes]: one member's record of the instance."""
ForwardedRankRow = tuple[
    Index, Count, Index, Annotated[Text, Field(max_length=255)], Seconds, Seconds, Seconds, Seconds | None
]
"""[rank, step, stage, host, compute seconds, data seconds, step seconds, own compute seconds or null]:
attribution figures (own compute: compute less the rank's TP collectives; null when its records were capped)."""


class ForwardedInstance(_Model):
    """One node's members of a collective/p2p instance that spans nodes (sidecar/crossnode.py)."""

    op: CollectiveOp
    """The instance's op label: the collective's op, or "send" for a p2p transfer."""
    group: CollectiveGroup
    seq: Count
    link: Flag
    """true: a p2p transfer, members = [src, dst]; false: a collective, members = its group's ranks."""
    members: list[Index] = Field(min_length=2, max_length=100_000)
    step: Count
    """The step the node first saw it in."""
    got: list[ForwardedMember] = Field(min_length=1, max_length=MAX_NODE_RANKS)

    @model_validator(mode="after")
    def _consistent(self):
        if self.link and len(self.members) != 2:
            raise ValueError(f"a p2p instance (link: true) has members [src, dst]; got {len(self.members)} ranks")
        if len(set(self.members)) != len(self.members):
            raise ValueError("members must be distinct ranks")
        ranks = [m[0] for m in self.got]
        if len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.members):
            raise ValueError("got must hold distinct ranks, each one of members")
        return self


class InstancesForward(_Model):
    """POST /v1/instances: a node sidecar hands the leader what only the leader can match."""

    version: Literal[1]
    node: Annotated[Text, Field(min_length=1, max_length=255)]
    run_id: RunId
    instances: list[ForwardedInstance] = Field(default_factory=list, max_length=MAX_FORWARD_HALVES)
    ranks: list[ForwardedRankRow] = Field(default_factory=list, max_length=MAX_FORWARD_RANK_ROWS)


class GlobalStage(_Model):
    stage: Index
    compute_seconds: Seconds
    idle_seconds: SignedSeconds
    other_seconds: Seconds = 0.0
    step_seconds: Seconds
    bubble_ratio: Ratio
    # The bubble split into its causes (rank 0's collector, when the trainer announced its pipeline order).
    bubble_schedule_ratio: Ratio | None = None
    bubble_imbalance_ratio: Ratio | None = None
    bubble_wait_ratio: Ratio | None = None


BUBBLE_CAUSES = ("schedule", "imbalance", "wait")
"""GlobalStage.bubble_<cause>_ratio, exported as parwatch_stage_bubble_<cause>_ratio."""


class GlobalView(_Model):
    step: Count
    loss: WireFloat = None
    pipeline_skew_ratio: Ratio | None = None
    stages: list[GlobalStage] = Field(default_factory=list, max_length=4096)


class StepSummary(_Model):
    v: SchemaVersion
    run_id: RunId
    rank: Index
    stage: Index
    tp_rank: Index = 0
    dp_rank: Index = 0
    tp: Parallel
    pp: Parallel
    dp: Parallel
    microbatches: Parallel
    chunks: Annotated[int, Field(strict=True, ge=1, le=1024)] = 1
    schedule: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    step: Count
    timeline: SmallCount = 0
    """Rollbacks applied so far in this run: (run_id, rank, timeline, step) names one summary.
    Collectors older than the field send none (0)."""
    time: Annotated[float, Field(strict=True, ge=0, le=MAX_TIME, allow_inf_nan=False)]
    step_seconds: Seconds
    compute_seconds: Seconds
    other_seconds: Seconds = 0.0
    idle_seconds: SignedSeconds
    bubble_ratio: Ratio
    bubble_theoretical_ratio: Ratio
    loss: WireFloat = None
    tokens: Count = 0
    memory_max_allocated_bytes: Count | None = None
    collectives: list[Collective] = Field(default_factory=list, max_length=256)
    gpu: Gpu | None = None
    nvml_up: Annotated[Literal[0, 1], BeforeValidator(_not_bool)] = 0
    overhead_seconds: Seconds = 0.0
    dropped_total: Count = 0
    checkpoints: list[Count] = Field(default_factory=list, max_length=MAX_CHECKPOINTS)
    paused: Flag = False
    global_: GlobalView | None = Field(default=None, alias="global")
    instances: Instances | None = None
    # Not in schema v1's list; exported as parwatch_model_flops_utilization_ratio when a collector sends it.
    model_flops_utilization_ratio: (
        Annotated[float, Field(strict=True, ge=0, le=MAX_RATIO, allow_inf_nan=False)] | None
    ) = None
    time_seconds: dict[vocabulary.TimeCategory, LedgerSeconds] | None = Field(default=None, max_length=32)
    """The rank's goodput ledger since its process started (cumulative; parwatch.collector.ledger)."""
    process_start_time: Timestamp | None = None
    """When this rank's process started (unix seconds): a later one is a restart of the rank (its
    ledger starts again, and the time between is down)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def world(self) -> tuple[int, int, int]:
        return self.tp, self.pp, self.dp

    @property
    def key(self) -> tuple[int, int]:
        """(timeline, step): a rank's summaries in training order, whatever their `time` says."""
        return self.timeline, self.step

    @model_validator(mode="after")
    def _layout_fits(self):
        if self.world_size > MAX_PARALLEL:
            raise ValueError(f"tp*pp*dp = {self.world_size} ranks is over the {MAX_PARALLEL} a sidecar accepts")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of tp*pp*dp = {self.world_size} ranks")
        if self.stage >= self.pp:
            raise ValueError(f"stage {self.stage} is outside pp = {self.pp} stages")
        if self.tp_rank >= self.tp or self.dp_rank >= self.dp:
            raise ValueError(f"tp_rank {self.tp_rank} / dp_rank {self.dp_rank} outside tp={self.tp}, dp={self.dp}")
        if self.global_ is not None and any(st.stage >= self.pp for st in self.global_.stages):
            raise ValueError(f"global.stages names a stage outside pp = {self.pp} stages")
        return self


class IngestBody(_Model):
    version: SchemaVersion
    summaries: list[StepSummary] = Field(max_length=10_000)
    outcomes: list[OutcomeRecord] = Field(default_factory=list, max_length=64)
    """Rank 0: directive outcome records, resent until a post carrying them is accepted."""
    alive: Flag = False
    """Rank 0, paused: every rank completed a heartbeat collective since its previous post."""


class Problem(BaseModel):
    """Every 4xx answer: `detail` names the field (or header, or limit) and the fix."""

    detail: str


class Directive(_Model):
    id: int
    action: DirectiveAction
    run_id: str
    to_step: int | None = None
    skip_batches: int = 0
    reason: str = ""


class IngestResponse(BaseModel):
    accepted: int
    directive: Directive | None


class ControlRequest(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True)
    action: DirectiveAction
    to_step: MaxStep | None = None  # the contract's bound (parse_directive): what passes, the trainer takes
    skip_batches: MaxStep = 0
    reason: Annotated[str, Field(max_length=2000)] = ""
    requested_by: Annotated[str, Field(max_length=200)] = ""


class CancelRequest(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True)
    requested_by: Annotated[str, Field(max_length=200)] = ""


class Alert(_Model):
    status: Literal["firing", "resolved"]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = ""
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: Annotated[str, Field(max_length=128)] = ""


class AlertmanagerPayload(_Model):
    """Alertmanager webhook payload, version 4."""

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""
    alerts: list[Alert] = Field(default_factory=list, max_length=10_000)


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
