"""A run's steps on the wire: what a rank posts to its sidecar each step, and the answer.

POST /v1/ingest  IngestBody: {"version": 1, "summaries": [StepSummary, ...], "outcomes": [OutcomeRecord, ...],
                 "checks": [StepCheckRecord, ...], "alive": bool}; answered with IngestResponse, whose
                 `directive` (the contract's Directive, or null) is what rank 0 applies at its next boundary
                 and `refused` the summaries refused alone (a step ahead of the run), the rest taken.

The collector builds these records and encodes them (parwatch/collector/); the sidecar decodes a body into
them in one call. Unknown keys are ignored, so a newer collector can add fields without breaking an older
sidecar. Bounds: parwatch/wire/bounds.py.
"""

from __future__ import annotations

import operator
from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from parwatch.contract.directives import MAX_STEP, Directive
from parwatch.rank_layout import DEFAULT_ORDER, RankLayout, cached_layout
from parwatch.vocabulary import (
    CollectiveOp,
    GroupRole,
    Outcome,
    SelfPart,
    StepAction,
    StepFault,
    TimeCategory,
    Triage,
)
from parwatch.wire.bounds import (
    MAX_CHECKPOINTS,
    MAX_RATIO,
    MAX_SECONDS,
    MAX_WORLD,
    Bandwidth,
    Count,
    Host,
    LedgerSeconds,
    Order,
    Parallel,
    Pid,
    Rank,
    RankList,
    Ranks,
    Ratio,
    RunId,
    Seconds,
    SignedCount,
    SignedSeconds,
    Step,
    Timeline,
    Timestamp,
    WireFloat,
    check_number,
    decode_float,
    text,
)

# Histogram upper bounds (seconds) of a collective's latency: 10 us .. 10 s, denser near the 1-50 ms
# range where TP all-reduces and p2p live and alert thresholds sit.
COLLECTIVE_BUCKETS = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for an op over n ranks (a collective's `busbw` is algbw times it)."""
    if n <= 1:
        return 1.0 if op in (CollectiveOp.SEND, CollectiveOp.RECV, CollectiveOp.BROADCAST) else 0.0
    if op == CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
        return (n - 1) / n
    return 1.0


class Collective(Struct, frozen=True, kw_only=True):
    op: CollectiveOp
    group: GroupRole
    count: Count
    seconds: Seconds
    bytes: Count = 0
    buckets: Annotated[list[Count], Meta(max_length=len(COLLECTIVE_BUCKETS) + 1)] = field(default_factory=list)
    """Cumulative counts per COLLECTIVE_BUCKETS bound (le), optionally + "+Inf" (= count)."""
    algbw: Bandwidth = 0.0
    busbw: Bandwidth = 0.0

    def __post_init__(self) -> None:
        n = len(COLLECTIVE_BUCKETS)
        if self.buckets:
            if len(self.buckets) not in (n, n + 1):
                raise ValueError(f"buckets has {len(self.buckets)} counts; expected {n} (one per le bound) or {n + 1}")
            # map() keeps the per-collective check in C: it runs for every collective of every post.
            if not all(map(operator.le, self.buckets, self.buckets[1:])) or self.buckets[-1] > self.count:
                raise ValueError("buckets must be cumulative (non-decreasing) and end at most at count")


class Gpu(Struct, frozen=True, kw_only=True):
    """NVML's view of the rank's device (parwatch/collector/nvml.py)."""

    index: Annotated[int, Meta(ge=0, le=1024)]
    utilization_ratio: Annotated[float, Meta(ge=0, le=1)] | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    power_watts: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    sm_clock_hertz: Annotated[float, Meta(ge=0, le=1e12)] | None = None
    temperature_celsius: Annotated[float, Meta(ge=-300, le=1e4)] | None = None
    throttle_reasons: Annotated[int, Meta(ge=0)] | None = None
    """NVML's 64-bit mask (msgspec's bounds stop at int64: the top bit is checked below)."""

    def __post_init__(self) -> None:
        if self.throttle_reasons is not None and self.throttle_reasons >= 2**64:
            raise ValueError("throttle_reasons: must fit in 64 bits (NVML's clocks-event mask)")


InstanceRecord = tuple[CollectiveOp, GroupRole, Count, SignedCount, SignedCount, Count, Count]
"""[op, group, seq, peer, start_us, dur_us, bytes]: one collective or p2p call of a sampled step
(parwatch/collector/instances.py). peer is -1 for a collective; seq is the call's number on its group
(per direction and peer for p2p)."""


class Instances(Struct, frozen=True, kw_only=True):
    """Raw material of the sidecar's wait/transfer split (sidecar/transfer.py)."""

    host: Host = ""
    """Ranks of one host share its monotonic clock."""
    data_seconds: Seconds = 0.0
    """This step's data-fetch spans."""
    groups: Annotated[dict[GroupRole, Annotated[list[Count], Meta(max_length=MAX_WORLD)]], Meta(max_length=64)] = field(
        default_factory=dict
    )
    """role -> the global ranks of the collective group recorded."""
    records: Annotated[list[InstanceRecord], Meta(max_length=20_000)] = field(default_factory=list)
    capped: Count = 0
    """Instances over the per-group budget, not recorded."""


class GlobalStage(Struct, frozen=True, kw_only=True):
    """One stage's figures in rank 0's view: the means over its reporting ranks."""

    stage: Rank
    compute_seconds: Seconds
    idle_seconds: SignedSeconds
    other_seconds: Seconds = 0.0
    step_seconds: Seconds
    bubble_ratio: Ratio
    forward_seconds: Seconds = 0.0
    backward_seconds: Seconds = 0.0
    """Input-gradient backward (all of the backward unless the schedule splits off the weight gradient)."""
    backward_weight_seconds: Seconds = 0.0
    loss_seconds: Seconds = 0.0
    ranks: Annotated[int, Meta(ge=1, le=MAX_WORLD)] = 1
    """The stage's ranks that reported this step (the figures are their means)."""
    # The bubble split into its causes (BubbleCause; when the trainer announced its pipeline order).
    bubble_schedule_ratio: Ratio | None = None
    bubble_imbalance_ratio: Ratio | None = None
    bubble_wait_ratio: Ratio | None = None


class GlobalView(Struct, frozen=True, kw_only=True):
    """Rank 0's fast-path view of the step before (one step of lag; parwatch/collector/global_view.py)."""

    step: Step
    wire_loss: WireFloat = field(default=None, name="loss")
    pipeline_skew_ratio: Ratio | None = None
    slowest_stage: Rank | None = None
    """The stage with the most compute this step."""
    stages: Annotated[list[GlobalStage], Meta(max_length=MAX_WORLD)] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_number(self.wire_loss, "loss")

    @property
    def loss(self) -> float | None:
        return decode_float(self.wire_loss)


class StepChecked(Struct, frozen=True, kw_only=True):
    """What the check before the optimizer step did with a bad step (every rank's summary of it carries it)."""

    action: StepAction
    fault: StepFault
    triage: Triage
    applied: bool
    """The update went in (a transient's re-run)."""
    ranks: Annotated[list[Rank], Meta(max_length=64)] = field(default_factory=list)
    """The ranks that produced it (the first 64)."""


class StepSummary(Struct, frozen=True, kw_only=True):
    """One rank's step (parwatch/collector/wire.py builds it): one per rank and step."""

    v: Literal[1]
    run_id: RunId
    rank: Rank
    stage: Rank
    tp_rank: Rank = 0
    dp_rank: Rank = 0
    tp: Parallel
    pp: Parallel
    dp: Parallel
    order: Order = DEFAULT_ORDER
    """The run's rank order, fastest first (parwatch.rank_layout); rank and coordinates agree with it."""
    microbatches: Parallel
    chunks: Annotated[int, Meta(ge=1, le=1024)] = 1
    """v: model chunks per stage."""
    schedule: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")]
    """The schedule's name ("gpipe", "1f1b", "interleaved1f1b", or torch pipelining's e.g. "ZBVZeroBubble")."""
    step: Step
    """The optimizer step this summary describes (1-based)."""
    timeline: Timeline = 0
    """Rollbacks applied so far in this run: (run_id, rank, timeline, step) names one summary, so a
    replayed step is not a retry."""
    time: Timestamp
    """When the step ended on this rank."""
    step_seconds: Seconds
    """Boundary-to-boundary period on this rank."""
    compute_seconds: Seconds
    """Forward and backward spans."""
    other_seconds: Seconds = 0.0
    """Optimizer and DP gradient sync."""
    idle_seconds: SignedSeconds
    """step - compute - other."""
    bubble_ratio: Ratio
    """idle / (idle + compute) (parwatch.bubble)."""
    bubble_theoretical_ratio: Ratio
    """The schedule's closed form, or the replay of its own actions at equal action times (parwatch.bubble)."""
    wire_loss: WireFloat = field(default=None, name="loss")
    tokens: Count = 0
    """Tokens the whole run consumed in this step (all DP replicas)."""
    memory_max_allocated_bytes: Count | None = None
    collectives: Annotated[list[Collective], Meta(max_length=256)] = field(default_factory=list)
    gpu: Gpu | None = None
    nvml_up: Literal[0, 1] = 0
    overhead_seconds: Seconds = 0.0
    """Time the collector itself spent on the training thread this step."""
    self_seconds: Annotated[dict[SelfPart, LedgerSeconds], Meta(max_length=8)] | None = None
    """parwatch's own time on this rank since its process started, by part (cumulative): span hooks and the
    collector on the training thread, the shipper's and the activity reporter's threads (CPU)."""
    dropped_total: Count = 0
    """Summaries this rank's shipper dropped so far."""
    checkpoints: Annotated[list[Step], Meta(max_length=MAX_CHECKPOINTS)] = field(default_factory=list)
    """Steps with a complete checkpoint (rank 0; [] elsewhere)."""
    paused: bool = False
    global_: GlobalView | None = field(default=None, name="global")
    """Rank 0 only."""
    instances: Instances | None = None
    model_flops_utilization_ratio: Annotated[float, Meta(ge=0, le=MAX_RATIO)] | None = None
    """Model FLOPs of the step / (step_seconds * peak); null unless the device's peak FLOP/s is configured."""
    time_seconds: Annotated[dict[TimeCategory, LedgerSeconds], Meta(max_length=32)] | None = None
    """The rank's goodput ledger since its process started (cumulative; they sum to the process's wall
    time at this boundary; parwatch.collector.ledger)."""
    process_start_time: Timestamp | None = None
    """When this rank's process started: a later one is a restart (its ledger starts again, and the
    time between is down)."""
    check: StepChecked | None = None
    """Set when the check before the optimizer step found this step bad (parwatch.contract.step_check)."""
    pid: Pid | None = None
    """The posting process: on its node, the sidecar proves the connection is that pid's and reads its real
    start; then only that process speaks for the rank until it ends (a restart needs it gone)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> RankLayout:
        return cached_layout(self.tp, self.pp, self.dp, self.order)

    @property
    def key(self) -> tuple[int, int]:
        """(timeline, step): a rank's summaries in training order, whatever their `time` says."""
        return self.timeline, self.step

    @property
    def loss(self) -> float | None:
        return decode_float(self.wire_loss)

    def __post_init__(self) -> None:
        check_number(self.wire_loss, "loss")
        if self.world_size > MAX_WORLD:
            raise ValueError(f"tp*pp*dp = {self.world_size} ranks is over the {MAX_WORLD} a sidecar accepts")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of tp*pp*dp = {self.world_size} ranks")
        if self.stage >= self.pp:
            raise ValueError(f"stage {self.stage} is outside pp = {self.pp} stages")
        if self.tp_rank >= self.tp or self.dp_rank >= self.dp:
            raise ValueError(f"tp_rank {self.tp_rank} / dp_rank {self.dp_rank} outside tp={self.tp}, dp={self.dp}")
        wrong = self.layout.mismatch(self.rank, (self.tp_rank, self.stage, self.dp_rank))
        if wrong is not None:
            raise ValueError(wrong)
        if self.global_ is not None and any(st.stage >= self.pp for st in self.global_.stages):
            raise ValueError(f"global.stages names a stage outside pp = {self.pp} stages")


class LocalDecision(Struct, frozen=True, kw_only=True):
    """A decision rank 0 made itself while its sidecar was unreachable (parwatch/collector/fallback.py),
    riding the outcome record of its directive: the leader records it and judges the loss."""

    rule: Literal["nonfinite-loss"]
    action: Literal["pause"]
    step: Step
    """The step whose loss was non-finite."""
    loss: WireFloat = None
    """As the wire carries it: the engine reads it with float()."""
    time: Timestamp
    """When rank 0 decided (its wall clock)."""
    after: Step = 0
    """The last directive id the ranks handled before it: the leader's later ones were never taken."""
    checkpoints: Annotated[list[Step], Meta(max_length=MAX_CHECKPOINTS)] = field(default_factory=list)
    """Rank 0's complete checkpoints then (a rollback target must be one)."""
    unreachable_since: Timestamp | None = None
    reason: Annotated[str, text(1000)] = ""

    def __post_init__(self) -> None:
        check_number(self.loss, "loss")


class PassEvidence(Struct, frozen=True, kw_only=True):
    """One pass of a bad step as the check saw it (the first, or the re-run)."""

    loss: WireFloat = None
    grad_sq_sum: WireFloat = None
    """The ranks' squared gradient norms, summed."""
    baseline: Annotated[float, Meta(ge=-MAX_RATIO * MAX_SECONDS, le=MAX_RATIO * MAX_SECONDS)] | None = None
    """The spike baseline: the median of the previous applied steps' losses."""
    nonfinite_loss: RankList = field(default_factory=list)
    nonfinite_grads: RankList = field(default_factory=list)
    spiked: RankList = field(default_factory=list)

    def __post_init__(self) -> None:
        check_number(self.loss, "loss")
        check_number(self.grad_sq_sum, "grad_sq_sum")


class CheckEvidence(Struct, frozen=True, kw_only=True):
    first: PassEvidence
    rerun: PassEvidence | None = None
    skipped_steps: Annotated[list[Step], Meta(max_length=10_000)] = field(default_factory=list)
    """The steps skipped within the policy's window, this one included."""
    pause: Annotated[str, text(300)] = ""
    """Why the run pauses (a pause only)."""


class StepCheckRecord(Struct, frozen=True, kw_only=True):
    """Rank 0's report of a step every rank checked before the optimizer step and found bad, decided by all
    ranks together (parwatch.contract.step_check); it rides every post until one carrying it is accepted."""

    run_id: RunId
    step: Step
    timeline: Timeline = 0
    time: Timestamp
    """When rank 0 ended the step's check (its wall clock)."""
    fault: StepFault
    action: StepAction
    triage: Triage
    applied: bool
    ranks: RankList = field(default_factory=list)
    """The ranks that produced the fault."""
    batch: Step | None = None
    loss: WireFloat = None
    """The loss of the pass decided on (the re-run's after a re-run)."""
    evidence: CheckEvidence

    def __post_init__(self) -> None:
        check_number(self.loss, "loss")


class OutcomeRecord(Struct, frozen=True, kw_only=True):
    """Rank 0's report of what every rank did with one directive (counted in the step-boundary vector);
    it rides every post until one carrying it is accepted."""

    directive_id: Annotated[int, Meta(gt=0, lt=MAX_STEP)]
    run_id: RunId
    outcome: Outcome
    """substituted: a rollback loaded an older verified checkpoint than asked; ignored: another run's;
    mixed: the ranks differ."""
    step: Step
    loaded_step: Step | None = None
    counts: dict[Outcome, Ranks] = field(default_factory=dict)
    """outcome -> ranks."""
    reasons: Annotated[dict[Annotated[str, Meta(pattern=r"^[a-z_]{1,32}\Z")], Ranks], Meta(max_length=16)] = field(
        default_factory=dict
    )
    ranks: Annotated[int, Meta(ge=1, le=MAX_WORLD)]
    local: LocalDecision | None = None
    """Set when rank 0 made this directive itself (its sidecar was unreachable)."""


class IngestBody(Struct, frozen=True, kw_only=True):
    """POST /v1/ingest. Summaries may be empty (rank 0 polling for a directive while the run is paused)."""

    version: Literal[1]
    summaries: Annotated[list[StepSummary], Meta(max_length=10_000)]
    outcomes: Annotated[list[OutcomeRecord], Meta(max_length=64)] = field(default_factory=list)
    """Rank 0: directive outcome records, resent until a post carrying them is accepted."""
    checks: Annotated[list[StepCheckRecord], Meta(max_length=64)] = field(default_factory=list)
    """Rank 0: the steps the check before the optimizer step found bad, resent until accepted."""
    alive: bool = False
    """Rank 0, paused: every rank completed a heartbeat collective since its previous post."""


class HeldSummary(Struct, frozen=True, kw_only=True):
    index: int
    """The summary's place in the post."""
    reason: str
    """Why it was refused (a step further ahead than the other ranks' reports allow)."""


class IngestResponse(Struct, frozen=True, kw_only=True):
    accepted: int
    """Summaries taken."""
    refused: list[HeldSummary] = field(default_factory=list)
    """Summaries refused alone, the rest of the post taken; absent when none was."""
    directive: Directive | None
    """What rank 0 applies at its next step boundary (the contract's record: parse_directive reads it)."""
