"""Who this rank is in the run: the facts every step summary repeats.

One frozen object per rank, built once by the trainer (or by any other trainer
that uses the collector), so the collector never has to ask torch.distributed.
A trainer may lay its ranks out in any order of tp, pp and dp: the context carries
that order (parwatch.rank_layout; "tp-pp-dp", TP ranks adjacent, then PP stages,
then DP outermost, unless given) and coordinates that agree with it. `for_rank`
derives the coordinates from the rank and the order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypedDict, cast

from parwatch.bubble import closed_form
from parwatch.host import host_identity
from parwatch.rank_layout import DEFAULT_ORDER, LayoutError, RankLayout
from parwatch.vocabulary import canonical_schedule, schedule


class Placement(TypedDict):
    """The run and a rank's place in it, as every record the rank sends names them."""

    run_id: str
    rank: int
    stage: int
    tp_rank: int
    dp_rank: int
    tp: int
    pp: int
    dp: int
    order: str


_SCHEDULE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class RunContext:
    run_id: str
    """The run's id: the same on every rank; metadata, never a metric label."""
    rank: int
    """This process's global rank, 0 .. world_size-1."""
    world_size: int
    """Number of ranks in the run; must equal tp * pp * dp."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline-parallel degree (number of stages)."""
    dp: int
    """Data-parallel degree (model replicas)."""
    tp_rank: int
    """This rank's index in its TP group (0..tp-1)."""
    dp_rank: int
    """This rank's DP replica (0..dp-1)."""
    stage: int
    """This rank's pipeline stage (0..pp-1); with several chunks per rank, the rank's position in the pipeline."""
    schedule: str
    """Pipeline schedule name: one of parwatch.vocabulary.SCHEDULES (an alias or torch class name of one
    becomes its name), or any other label of letters, digits, _ . -."""
    microbatches: int
    """Microbatches per step (m)."""
    chunks: int = 1
    """Model chunks per stage (v); 1 unless the schedule is interleaved."""
    tokens_per_step: int = 0
    """Tokens the whole run (all DP replicas) consumes per optimizer step; 0 if unknown."""
    local_gpu: int | None = None
    """CUDA device index this rank uses, or None on CPU (no NVML, no CUDA clock)."""
    hostname: str = field(default_factory=host_identity)
    """Host this rank runs on ($PARWATCH_HOST, else the hostname): host contention is judged by it."""
    order: str = DEFAULT_ORDER
    """The run's rank order, fastest dimension first (parwatch.rank_layout): "tp-pp-dp" by default,
    Megatron-Core's "tp-cp-ep-dp-pp" for its default; kept in the layout's canonical form."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp", "microbatches", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RunContext.{name}={value!r} must be a positive integer")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"RunContext: tp*pp*dp = {self.tp}*{self.pp}*{self.dp} does not equal "
                f"world_size={self.world_size}; pass the layout the trainer was started with"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RunContext.rank={self.rank} must be in 0..{self.world_size - 1}")
        for name, size in (("tp_rank", "tp"), ("stage", "pp"), ("dp_rank", "dp")):
            value, limit = getattr(self, name), getattr(self, size)
            if not isinstance(value, int) or not 0 <= value < limit:
                raise ValueError(f"RunContext.{name}={value!r} must be in 0..{limit - 1} ({size}={limit})")
        try:
            layout = RankLayout(self.tp, self.pp, self.dp, self.order)
        except LayoutError as err:
            raise ValueError(f"RunContext.order: {err}") from None
        object.__setattr__(self, "order", layout.order)
        wrong = layout.mismatch(self.rank, (self.tp_rank, self.stage, self.dp_rank))
        if wrong is not None:
            raise ValueError(f"RunContext: {wrong}; pass the order the run's ranks were laid out in")
        if not isinstance(self.schedule, str) or not _SCHEDULE_NAME.match(self.schedule):
            raise ValueError(
                f"RunContext.schedule={self.schedule!r} must be a schedule name of letters, digits, "
                "'_', '.', '-' (at most 64), e.g. 1f1b or ZBVZeroBubble"
            )
        object.__setattr__(self, "schedule", canonical_schedule(self.schedule))  # one name per schedule
        entry = schedule(self.schedule)
        if self.chunks > 1 and entry is not None and entry.one_chunk:
            raise ValueError(
                f"RunContext.chunks={self.chunks} needs an interleaved schedule (got {self.schedule!r}); "
                "use chunks=1 for gpipe and 1f1b"
            )
        if self.tokens_per_step < 0:
            raise ValueError(f"RunContext.tokens_per_step={self.tokens_per_step} must be >= 0")

    @classmethod
    def for_rank(
        cls,
        run_id: str,
        rank: int,
        *,
        tp: int,
        pp: int,
        dp: int,
        schedule: str,
        microbatches: int,
        chunks: int = 1,
        tokens_per_step: int = 0,
        local_gpu: int | None = None,
        hostname: str | None = None,
        order: str = DEFAULT_ORDER,
    ) -> RunContext:
        """Derive tp_rank, stage and dp_rank from the rank and the layout in `order`."""
        try:
            at = RankLayout(tp, pp, dp, order).coords(rank)
        except LayoutError as err:
            raise ValueError(f"RunContext.for_rank: {err}") from None
        return cls(
            run_id=run_id,
            rank=rank,
            world_size=tp * pp * dp,
            tp=tp,
            pp=pp,
            dp=dp,
            **at._asdict(),
            schedule=schedule,
            microbatches=microbatches,
            chunks=chunks,
            tokens_per_step=tokens_per_step,
            local_gpu=local_gpu,
            hostname=hostname if hostname is not None else host_identity(),
            order=order,
        )

    @cached_property
    def placement(self) -> Placement:
        return cast(Placement, {name: getattr(self, name) for name in Placement.__annotations__})

    @property
    def bubble_theoretical_ratio(self) -> float:
        """(p-1)/(v*m+p-1): the bubble share the schedule itself implies (a schedule without a
        closed form has its replay instead, once the trainer announces its order)."""
        return closed_form(self.pp, self.microbatches, self.chunks)
