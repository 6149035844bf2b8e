"""The parallel layout (tp, pp, dp) as one object, checked when it is built.

Rank order: parwatch.rank_layout's default (TP ranks adjacent, PP stages next, DP outermost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from parwatch.rank_layout import Coords, RankLayout
from parwatch.trainer.errors import ConfigError

if TYPE_CHECKING:  # torch is imported when the groups are built
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    """Tensor-parallel degree: ranks that split each layer's matrices."""
    pp: int
    """Pipeline-parallel degree: number of stages."""
    dp: int
    """Data-parallel degree: model replicas that average gradients."""
    world_size: int
    """Number of processes; must equal tp * pp * dp."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        product = self.tp * self.pp * self.dp
        if product != self.world_size:
            if self.world_size % (self.tp * self.dp) == 0:
                fix = f"use --pp {self.world_size // (self.tp * self.dp)} or --nproc {product}"
            else:
                fix = f"use --nproc {product}"
            raise ConfigError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {product} does not equal the world size "
                f"{self.world_size}; {fix}"
            )

    @cached_property
    def layout(self) -> RankLayout:
        return RankLayout(self.tp, self.pp, self.dp)

    def coords(self, rank: int) -> Coords:
        return self.layout.coords(rank)

    def tp_group_ranks(self) -> list[list[int]]:
        return [list(g) for g in self.layout.groups("tp")]

    def pp_group_ranks(self) -> list[list[int]]:
        return [list(g) for g in self.layout.groups("pp")]

    def dp_group_ranks(self) -> list[list[int]]:
        return [list(g) for g in self.layout.groups("dp")]


@dataclass
class ProcessGroups:
    """The process groups this rank belongs to, named by role."""

    dims: ParallelDims
    coords: Coords
    tp: ProcessGroup | None = None
    """None: a group of one."""
    pp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this rank's pipeline, by stage
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)

    @property
    def stage(self) -> int:
        return self.coords.stage

    @property
    def is_last_stage(self) -> bool:
        return self.coords.stage == self.dims.pp - 1


def build_groups(dims: ParallelDims, rank: int) -> ProcessGroups:
    """Create every TP, PP and DP group (all ranks must call this, in the same order)."""
    import torch.distributed as dist

    groups = ProcessGroups(dims=dims, coords=dims.coords(rank))
    for role, layouts in (("tp", dims.tp_group_ranks()), ("pp", dims.pp_group_ranks()), ("dp", dims.dp_group_ranks())):
        for ranks in layouts:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(groups, role, group)
                setattr(groups, f"{role}_ranks", ranks)
    return groups
