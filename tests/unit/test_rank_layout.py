"""RankLayout: rank <-> (tp_rank, stage, dp_rank) in any order of tp, pp and dp, against the layouts
the frameworks themselves build (Megatron-Core's RankGenerator, DeepSpeed's ProcessTopology)."""

from __future__ import annotations

import itertools
import re

import pytest

from parwatch.rank_layout import (
    DEFAULT_ORDER,
    ORDERS,
    Coords,
    LayoutError,
    RankLayout,
    canonical_order,
    order_of_axes,
    order_of_groups,
)

SIZES = [(1, 1, 1), (2, 1, 1), (1, 4, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2), (4, 2, 3), (3, 1, 2), (2, 3, 4)]
FIELD = {"tp": "tp_rank", "pp": "stage", "dp": "dp_rank"}


def layouts():
    for (tp, pp, dp), order in itertools.product(SIZES, [*ORDERS, "tp-cp-ep-dp-pp", "TP-CP-EP-PP-DP"]):
        yield RankLayout(tp, pp, dp, order)


@pytest.mark.parametrize("layout", list(layouts()), ids=str)
def test_coords_and_rank_of_are_inverse_for_every_rank(layout):
    seen = set()
    for rank in range(layout.world):
        c = layout.coords(rank)
        assert 0 <= c.tp_rank < layout.tp and 0 <= c.stage < layout.pp and 0 <= c.dp_rank < layout.dp
        assert layout.rank_of(*c) == rank
        assert layout.mismatch(rank, c) is None
        seen.add(c)
    assert len(seen) == layout.world  # a bijection


@pytest.mark.parametrize("layout", list(layouts()), ids=str)
def test_each_roles_groups_partition_the_world_and_vary_only_their_coordinate(layout):
    for role in ("tp", "pp", "dp"):
        groups = layout.groups(role)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(layout.world))
        assert all(len(g) == layout.size(role) for g in groups)
        for group in groups:
            coords = [layout.coords(r) for r in group]
            assert [getattr(c, FIELD[role]) for c in coords] == list(range(len(group)))  # group-rank order
            assert len({c._replace(**{FIELD[role]: 0}) for c in coords}) == 1, f"{role} group {group}"
            for c in coords:
                assert layout.group(role, c) == group


def test_the_default_order_is_tp_fastest_then_pp_then_dp():
    layout = RankLayout(2, 2, 2)
    assert layout.order == DEFAULT_ORDER == "tp-pp-dp"
    assert [list(g) for g in layout.groups("tp")] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(g) for g in layout.groups("pp")] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [list(g) for g in layout.groups("dp")] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(6) == Coords(tp_rank=0, stage=1, dp_rank=1)


def test_megatrons_default_order_puts_dp_inside_pp():
    layout = RankLayout(1, 2, 2, "tp-cp-ep-dp-pp")
    assert layout.order == "tp-dp-pp"
    assert [layout.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert layout != RankLayout(1, 2, 2)  # the default puts rank 1 at stage 1


def test_orders_that_differ_only_in_a_size_one_dimension_are_one_layout():
    """The canonical form is the first order of ORDERS that lays ranks out alike (the default if it does)."""
    assert RankLayout(2, 1, 2, "tp-dp-pp") == RankLayout(2, 1, 2)
    assert RankLayout(1, 2, 1, "tp-cp-ep-dp-pp").order == DEFAULT_ORDER
    assert RankLayout(1, 2, 2, "dp-pp").order == "tp-dp-pp"
    assert RankLayout(2, 2, 1, "pp-tp").order == "pp-tp-dp"
    for tp, pp, dp in SIZES:
        for a, b in itertools.product(ORDERS, repeat=2):
            x, y = RankLayout(tp, pp, dp, a), RankLayout(tp, pp, dp, b)
            assert (x == y) == (list(map(x.coords, range(x.world))) == list(map(y.coords, range(y.world))))


@pytest.mark.parametrize(
    "order, message",
    [
        ("tp-pp-xx", "unknown ['xx']"),
        ("tp-pp-tp-dp", "a dimension twice"),
        ("tp-pp", "does not place dp (size 2)"),
        (3, "must be a string"),
    ],
)
def test_an_order_that_does_not_fit_is_refused_naming_why(order, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        canonical_order(order, 2, 2, 2)


def test_mismatch_names_the_rank_its_coordinates_and_where_the_order_puts_it():
    layout = RankLayout(1, 2, 2, "tp-dp-pp")
    assert layout.mismatch(1, (0, 1, 0)) == (
        "rank 1 says tp_rank 0, stage 1, dp_rank 0, but order 'tp-dp-pp' (fastest first) "
        "puts it at tp_rank 0, stage 0, dp_rank 1"
    )
    assert "outside" in layout.mismatch(4, (0, 0, 0))
    with pytest.raises(LayoutError, match="rank 4 is outside"):
        layout.coords(4)
    with pytest.raises(LayoutError, match="tp=0 must be a positive integer"):
        RankLayout(0, 1, 1)


def test_row_major_axes_read_outermost_first():
    """A DeviceMesh's dimension names (torchtitan's) and DeepSpeed's axes: the last one is the fastest."""
    assert order_of_axes([("pp", 2), ("dp", 2), ("tp", 2)]) == "tp-dp-pp"
    assert order_of_axes([("pp", 2), ("dp", 2), ("dp", 3), ("dp", 1), ("tp", 2)]) == "tp-dp-pp"  # folded
    assert order_of_axes([("dp", 2), ("pp", 1), ("dp", 2), ("tp", 2)]) == "tp-dp"  # a size-1 axis between
    assert order_of_axes([]) == DEFAULT_ORDER
    with pytest.raises(LayoutError, match="the dp axes are not neighbours"):
        order_of_axes([("dp", 2), ("pp", 2), ("dp", 2), ("tp", 2)])


@pytest.mark.parametrize("layout", list(layouts()), ids=str)
def test_the_order_is_read_back_from_any_ranks_groups(layout):
    for rank in range(layout.world):
        at = layout.coords(rank)
        groups = {role: list(layout.group(role, at)) for role in ("tp", "pp", "dp")}
        assert RankLayout(layout.tp, layout.pp, layout.dp, order_of_groups(groups)) == layout


def test_groups_no_order_makes_are_refused():
    with pytest.raises(LayoutError, match=r"the tp group \[0, 1, 3\] is not evenly spaced"):
        order_of_groups({"tp": [0, 1, 3]})
    with pytest.raises(LayoutError, match="two groups are spaced alike"):
        order_of_groups({"tp": [0, 2], "dp": [0, 2]})


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "pp-tp-dp", "dp-tp-pp"])
@pytest.mark.parametrize("tp, pp, dp", [(1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 3, 2), (4, 2, 3)])
def test_groups_equal_megatrons_rank_generator(order, tp, pp, dp):
    """Megatron-Core's own RankGenerator (the one initialize_model_parallel builds its groups with)."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    layout = RankLayout(tp, pp, dp, order)
    for role in ("tp", "pp", "dp"):
        assert sorted(generator.get_ranks(role)) == sorted(list(g) for g in layout.groups(role)), role


@pytest.mark.parametrize("axes, dims", [(["pipe", "data", "model"], [2, 3, 2]), (["pipe", "data"], [2, 2])])
def test_coords_equal_deepspeeds_topology(axes, dims):
    """DeepSpeed's ProcessTopology (PipeModelDataParallelTopology's axes, and PipeDataParallelTopology's)."""
    topology_module = pytest.importorskip("deepspeed.runtime.pipe.topology")
    from parwatch.integrations.deepspeed import topology_order

    topology = topology_module.ProcessTopology(axes=axes, dims=dims)
    size = dict(zip(axes, dims))
    layout = RankLayout(size.get("model", 1), size["pipe"], size["data"], topology_order(topology))
    for rank in range(layout.world):
        coord = topology.get_coord(rank)
        assert layout.coords(rank) == (getattr(coord, "model", 0), coord.pipe, coord.data)
