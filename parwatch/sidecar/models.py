"""Pydantic models mirroring parwatch/schema.py: what the control listener accepts.

Validation errors become 400s whose reason names the field (see app.py), so every
constraint here says what was expected.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from parwatch.schema import COLLECTIVE_BUCKETS, DIRECTIVE_ACTIONS, SCHEMA_VERSION, decode_float

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")

# Loss may be a number, null, or one of the strings "nan", "inf", "-inf".
WireFloat = Annotated[float | None, BeforeValidator(decode_float)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegFinite = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
Label = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]


class _Model(BaseModel):
    # Unknown keys are ignored so a newer collector can add fields without breaking an older sidecar.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Collective(_Model):
    op: Literal[COLLECTIVE_OPS]
    group: Label
    count: Count
    seconds: NonNegFinite
    bytes: Count = 0
    buckets: list[Count] = Field(default_factory=list)
    algbw: NonNegFinite = 0.0
    busbw: NonNegFinite = 0.0

    @model_validator(mode="after")
    def _buckets_fit(self):
        n = len(COLLECTIVE_BUCKETS)
        if self.buckets:
            if len(self.buckets) not in (n, n + 1):
                raise ValueError(f"buckets has {len(self.buckets)} counts; expected {n} (one per le bound) or {n + 1}")
            if any(b > a for a, b in zip(self.buckets[1:], self.buckets)) or self.buckets[-1] > self.count:
                raise ValueError("buckets must be cumulative (non-decreasing) and end at most at count")
        return self


class Gpu(_Model):
    index: Count
    utilization_ratio: Annotated[float, Field(ge=0, le=1)] | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    power_watts: NonNegFinite | None = None
    sm_clock_hertz: NonNegFinite | None = None
    temperature_celsius: Finite | None = None
    throttle_reasons: int | list | None = None


MaxStep = Annotated[int, Field(ge=0, lt=2**53)]
RunId = Annotated[str, Field(min_length=1, max_length=200)]
OUTCOMES = ("applied", "substituted", "failed", "ignored", "mixed")


class OutcomeRecord(_Model):
    """Rank 0's report of what every rank did with one directive (counted in the boundary vector)."""

    directive_id: Annotated[int, Field(gt=0, lt=2**53)]
    run_id: RunId
    outcome: Literal[OUTCOMES]
    step: MaxStep
    loaded_step: MaxStep | None = None
    counts: dict[Literal[OUTCOMES], Annotated[int, Field(ge=0, le=2**31)]] = Field(default_factory=dict)
    reasons: dict[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")], Annotated[int, Field(ge=0, le=2**31)]] = \
        Field(default_factory=dict, max_length=16)
    ranks: Annotated[int, Field(ge=1, le=2**31)]


InstanceRecord = tuple[Literal[COLLECTIVE_OPS], Label, Count, int, int, Count, Count]
"""[op, group, seq, peer, start_us, dur_us, bytes] (parwatch/collector/instances.py)."""


class Instances(_Model):
    """One rank-step's collective/p2p instance records and data seconds (schema.py `instances`)."""

    host: Annotated[str, Field(max_length=255)] = ""
    data_seconds: NonNegFinite = 0.0
    groups: dict[Label, Annotated[list[Count], Field(max_length=100_000)]] = Field(default_factory=dict,
                                                                                   max_length=64)
    records: list[InstanceRecord] = Field(default_factory=list, max_length=20_000)
    capped: Count = 0


class GlobalStage(_Model):
    stage: Count
    compute_seconds: NonNegFinite
    idle_seconds: Finite
    other_seconds: NonNegFinite = 0.0
    step_seconds: NonNegFinite
    bubble_ratio: Finite


class GlobalView(_Model):
    step: Count
    loss: WireFloat = None
    pipeline_skew_ratio: Finite | None = None
    stages: list[GlobalStage] = Field(default_factory=list)


class StepSummary(_Model):
    v: Literal[SCHEMA_VERSION]
    run_id: Annotated[str, Field(min_length=1, max_length=200)]
    rank: Count
    stage: Count
    tp_rank: Count = 0
    dp_rank: Count = 0
    tp: Annotated[int, Field(ge=1)]
    pp: Annotated[int, Field(ge=1)]
    dp: Annotated[int, Field(ge=1)]
    microbatches: Annotated[int, Field(ge=1)]
    chunks: Annotated[int, Field(ge=1)] = 1
    schedule: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    step: Count
    timeline: Annotated[int, Field(ge=0, le=2**31)] = 0
    """Rollbacks applied so far in this run: (run_id, rank, timeline, step) names one summary."""
    time: Finite
    step_seconds: NonNegFinite
    compute_seconds: NonNegFinite
    other_seconds: NonNegFinite = 0.0
    idle_seconds: Finite
    bubble_ratio: Finite
    bubble_theoretical_ratio: Finite
    loss: WireFloat = None
    tokens: Count = 0
    memory_max_allocated_bytes: Count | None = None
    collectives: list[Collective] = Field(default_factory=list, max_length=256)
    gpu: Gpu | None = None
    nvml_up: Literal[0, 1] = 0
    overhead_seconds: NonNegFinite = 0.0
    dropped_total: Count = 0
    checkpoints: list[Count] = Field(default_factory=list, max_length=100_000)
    paused: bool = False
    global_: GlobalView | None = Field(default=None, alias="global")
    instances: Instances | None = None
    # Not in schema v1's list; exported as parwatch_model_flops_utilization_ratio when a collector sends it.
    model_flops_utilization_ratio: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @model_validator(mode="after")
    def _layout_fits(self):
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of tp*pp*dp = {self.world_size} ranks")
        if self.stage >= self.pp:
            raise ValueError(f"stage {self.stage} is outside pp = {self.pp} stages")
        if self.tp_rank >= self.tp or self.dp_rank >= self.dp:
            raise ValueError(f"tp_rank {self.tp_rank} / dp_rank {self.dp_rank} outside tp={self.tp}, dp={self.dp}")
        return self


class IngestBody(_Model):
    version: Literal[SCHEMA_VERSION]
    summaries: list[StepSummary] = Field(max_length=10_000)
    outcomes: list[OutcomeRecord] = Field(default_factory=list, max_length=64)
    """Rank 0: directive outcome records, resent until a post carrying them is accepted."""
    alive: bool = False
    """Rank 0, paused: every rank completed a heartbeat collective since its previous post."""


class Directive(_Model):
    id: int
    action: Literal[DIRECTIVE_ACTIONS]
    run_id: str
    to_step: int | None = None
    skip_batches: int = 0
    reason: str = ""


class IngestResponse(BaseModel):
    accepted: int
    directive: Directive | None


class ControlRequest(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True)
    action: Literal[DIRECTIVE_ACTIONS]
    to_step: Annotated[int, Field(ge=0)] | None = None
    skip_batches: Count = 0
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
    fingerprint: str = ""


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
