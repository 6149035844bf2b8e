"""The sidecar's GC pacing: survivors go to the permanent generation, and a cycle made meanwhile is
still freed by the periodic full collection."""

from __future__ import annotations

import gc
import weakref

import pytest

from parwatch.sidecar.gc_pacing import GcPacer


class _Node:
    pass


@pytest.fixture
def frozen_state():
    yield
    gc.unfreeze()  # the rest of the test session sees the collector as it was


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_tick_freezes_what_is_alive_and_the_full_collection_frees_its_cycles(frozen_state):
    now = [0.0]
    pacer = GcPacer(full_seconds=600.0, clock=lambda: now[0])
    alive = _cycle()
    pacer.tick()  # frozen: later collections do not walk it
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert alive() is not None  # a frozen cycle outlives ordinary collections
    now[0] = 599.0
    pacer.tick()
    gc.collect()
    assert alive() is not None and pacer.full_collections == 0
    now[0] = 600.0
    pacer.tick()  # the full collection: unfreeze, collect, freeze again
    assert alive() is None and pacer.full_collections == 1
    assert pacer.full_pause_seconds > 0 and gc.get_freeze_count() > 0


def test_a_cycle_made_after_the_last_tick_is_collected_as_usual(frozen_state):
    GcPacer(clock=lambda: 0.0).tick()
    young = _cycle()
    gc.collect()
    assert young() is None


def test_a_permanent_generation_that_keeps_growing_is_collected_before_the_ten_minutes(frozen_state):
    """Cycles that became garbage after being frozen wait for the full collection; a flood of them
    (say a stream of bad requests) triggers it early rather than growing the heap for ten minutes."""
    now = [0.0]
    pacer = GcPacer(full_seconds=600.0, clock=lambda: now[0], min_frozen=1)
    now[0] = 600.0
    pacer.tick()  # a full collection: the limit is GROWTH x what is alive now
    assert pacer.full_collections == 1
    now[0] = 611.0
    pacer.tick()
    assert pacer.full_collections == 1  # no growth, no collection
    gc.disable()  # the flood must reach the permanent generation (young cycles are collected as usual)
    try:
        flood = [_cycle() for _ in range(pacer.frozen_limit - gc.get_freeze_count() + 1000)]  # 2 objects each
        pacer.tick()  # freezes the flood (the check comes first)
    finally:
        gc.enable()
    assert pacer.full_collections == 1 and flood[0]() is not None
    now[0] = 615.0
    pacer.tick()  # the size is read every GROWTH_CHECK_SECONDS only
    assert pacer.full_collections == 1
    now[0] = 621.0
    pacer.tick()  # over the limit, long before ten minutes
    assert pacer.full_collections == 2 and all(r() is None for r in flood)
