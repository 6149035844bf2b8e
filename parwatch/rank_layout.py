"""The rank layout: which global rank sits at which (tp_rank, stage, dp_rank), in the run's own order.

Standard library and the vocabulary only, so the contract and the trainer import it too. An order
names the parallel dimensions fastest first, as Megatron-Core's `order` does: "tp-pp-dp" (the
reference trainer's, and what a record that carries no order means) puts TP ranks adjacent, then
the PP stages, DP outermost; Megatron-Core's default "tp-cp-ep-dp-pp" puts the DP replicas inside
the pipeline. A DeviceMesh's dimension names and DeepSpeed's topology axes are row-major (outermost
first): `order_of_axes` reads those; `order_of_groups` reads an order off a rank's process groups.

Every place that maps a rank to coordinates (the collector's RunContext, the sidecar's liveness,
digests and hang analysis, the integrations) reads one `RankLayout`. Two orders that differ only in
where a size-1 dimension sits lay ranks out alike: a layout keeps one of them (`canonical_order`),
the default whenever it is one, so layouts compare equal exactly when they map ranks alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import permutations
from typing import NamedTuple

from parwatch.vocabulary import GroupRole

ROLES: tuple[GroupRole, GroupRole, GroupRole] = (GroupRole.TP, GroupRole.PP, GroupRole.DP)
"""The dimensions parwatch places a rank in, in Coords' field order."""
UNIT_ROLES = (GroupRole.CP, GroupRole.EP)
"""Megatron-Core's other names in an order: a layout holds them at size 1 (its integration checks that)."""
SEPARATOR = "-"
DEFAULT_ORDER = SEPARATOR.join(ROLES)
"""tp fastest, then pp, then dp: the reference trainer's order, and a record's without one."""
ORDERS: tuple[str, ...] = tuple(SEPARATOR.join(p) for p in permutations(ROLES))
"""Every order of the three dimensions, the default first: the one a layout keeps is the first that fits."""


class Coords(NamedTuple):
    """Where a rank sits: its index in its TP group, its pipeline stage, its DP replica."""

    tp_rank: int
    stage: int
    dp_rank: int


class LayoutError(ValueError):
    """An order, a set of sizes or a rank's coordinates that do not fit together; the message names them."""


@lru_cache(maxsize=256)
def canonical_order(order: str, tp: int, pp: int, dp: int) -> str:
    """`order` (fastest first, e.g. Megatron's "tp-cp-ep-dp-pp") as the ORDERS entry a layout keeps:
    cp and ep dropped, a size-1 dimension wherever the first fitting entry of ORDERS puts it. A
    dimension of size > 1 the order leaves out, or a name twice or unknown, is a LayoutError."""
    if not isinstance(order, str):
        raise LayoutError(f"order={order!r} must be a string such as {DEFAULT_ORDER!r} (fastest dimension first)")
    names = [n.strip() for n in order.lower().split(SEPARATOR)]
    known = (*ROLES, *UNIT_ROLES)
    unknown = [n for n in names if n not in known]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {unknown}" if unknown else "a dimension twice"
        raise LayoutError(
            f"order {order!r} has {what}: name each of {', '.join(known)} at most once, fastest first "
            f"(e.g. {DEFAULT_ORDER!r}, or Megatron-Core's 'tp-cp-ep-dp-pp')"
        )
    sizes: dict[str, int] = {GroupRole.TP: tp, GroupRole.PP: pp, GroupRole.DP: dp}
    left_out = [f"{r} (size {sizes[r]})" for r in ROLES if r not in names and sizes[r] > 1]
    if left_out:
        raise LayoutError(f"order {order!r} does not place {', '.join(left_out)}")
    placed = [n for n in names if n in sizes and sizes[n] > 1]
    for candidate in ORDERS:
        if [n for n in candidate.split(SEPARATOR) if sizes[n] > 1] == placed:
            return candidate
    raise AssertionError("unreachable: every order of the placed dimensions is in ORDERS")


@dataclass(frozen=True)
class RankLayout:
    """A tp x pp x dp world laid out in `order`: rank <-> Coords, and the groups each role forms."""

    tp: int
    pp: int
    dp: int
    order: str = DEFAULT_ORDER
    """Fastest dimension first; kept as `canonical_order` gives it."""
    strides: Coords = field(init=False, repr=False, compare=False)
    """How far apart in rank two neighbours along tp, pp and dp are."""

    def __post_init__(self) -> None:
        for name, size in zip(ROLES, (self.tp, self.pp, self.dp)):
            if type(size) is not int or size < 1:
                raise LayoutError(f"{name}={size!r} must be a positive integer")
        order = canonical_order(self.order, self.tp, self.pp, self.dp)
        object.__setattr__(self, "order", order)
        sizes: dict[str, int] = {GroupRole.TP: self.tp, GroupRole.PP: self.pp, GroupRole.DP: self.dp}
        stride, strides = 1, {}
        for dim in order.split(SEPARATOR):
            strides[dim] = stride
            stride *= sizes[dim]
        object.__setattr__(self, "strides", Coords(*(strides[r] for r in ROLES)))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def size(self, role: str) -> int:
        return {GroupRole.TP: self.tp, GroupRole.PP: self.pp, GroupRole.DP: self.dp}[GroupRole(role)]

    def coords(self, rank: int) -> Coords:
        """The coordinates of `rank` (0 .. world-1)."""
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside {self} (ranks 0..{self.world - 1})")
        st, sp, sd = self.strides
        return Coords(rank // st % self.tp, rank // sp % self.pp, rank // sd % self.dp)

    def rank_of(self, tp_rank: int, stage: int, dp_rank: int) -> int:
        """The rank at these coordinates: `coords` read backwards."""
        st, sp, sd = self.strides
        return tp_rank * st + stage * sp + dp_rank * sd

    def group(self, role: str, at: Coords) -> range:
        """The global ranks of the `role` group (tp, pp or dp) through coordinates `at`, in group-rank order."""
        i = ROLES.index(GroupRole(role))
        start = self.rank_of(*(0 if j == i else c for j, c in enumerate(at)))
        stride = self.strides[i]
        return range(start, start + self.size(role) * stride, stride)

    def groups(self, role: str) -> list[range]:
        """Every `role` group, by the lowest rank in it: they partition the world."""
        i = ROLES.index(GroupRole(role))
        return [self.group(role, c) for c in map(self.coords, range(self.world)) if c[i] == 0]

    def mismatch(self, rank: int, at: Coords | Sequence[int]) -> str | None:
        """None when `rank` sits at coordinates `at` (tp_rank, stage, dp_rank) in this layout, else why not."""
        if not 0 <= rank < self.world:
            return f"rank {rank} is outside {self} (ranks 0..{self.world - 1})"
        expected = self.coords(rank)
        if tuple(at) == expected:
            return None
        return (
            f"rank {rank} says tp_rank {at[0]}, stage {at[1]}, dp_rank {at[2]}, but order {self.order!r} "
            f"(fastest first) puts it at tp_rank {expected.tp_rank}, stage {expected.stage}, dp_rank {expected.dp_rank}"
        )

    def __str__(self) -> str:
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp} in order {self.order}"


def order_of_axes(axes: Iterable[tuple[str, int]]) -> str:
    """The order of row-major axes (outermost first, as a DeviceMesh's dimensions or DeepSpeed's
    topology axes run), each given as (role, size) with role tp, pp or dp. Neighbouring axes of one
    role (a mesh's dp_replicate and dp_shard) are one dimension, the outer the more significant; a
    role split by another is a LayoutError (parwatch has one index per role)."""
    runs: list[str] = []
    for role, size in axes:
        if role not in ROLES:
            raise LayoutError(f"axis role {role!r}: each axis must be one of {', '.join(ROLES)}")
        if size > 1 and (not runs or runs[-1] != role):
            if role in runs:
                raise LayoutError(
                    f"the {role} axes are not neighbours ({' / '.join(r for r, _ in axes)}, outermost first): "
                    f"parwatch's layout has one {role} index, so the axes folded into it must be adjacent"
                )
            runs.append(role)
    return SEPARATOR.join(reversed(runs)) or DEFAULT_ORDER


def order_of_groups(groups: Mapping[str, Sequence[int]]) -> str:
    """The order a rank's process groups imply: role (tp, pp, dp) -> the global ranks of its group
    through this rank. In any of these orders each group is evenly spaced, the faster dimension the
    closer; a group that is not (or two at one spacing) is a LayoutError naming it."""
    strides: dict[str, int] = {}
    for role, members in groups.items():
        ranks = sorted(members)
        if len(ranks) < 2:
            continue
        step = ranks[1] - ranks[0]
        if ranks != list(range(ranks[0], ranks[0] + step * len(ranks), step)):
            raise LayoutError(f"the {role} group {ranks} is not evenly spaced: no order of tp, pp and dp makes it")
        strides[role] = step
    if len(set(strides.values())) != len(strides):
        raise LayoutError(f"two groups are spaced alike ({strides}): no order of tp, pp and dp makes them")
    return SEPARATOR.join(sorted(strides, key=strides.__getitem__)) or DEFAULT_ORDER


@lru_cache(maxsize=64)
def cached_layout(tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER) -> RankLayout:
    """RankLayout(tp, pp, dp, order), built once: what a record names is checked against it on every post."""
    return RankLayout(tp, pp, dp, order)
