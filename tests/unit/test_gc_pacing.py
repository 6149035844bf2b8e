"""The sidecar's GC pacing: survivors go to the permanent generation, and a cycle made meanwhile is
still freed by the periodic full collection."""

from __future__ import annotations

import gc
import sys
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


def test_a_heap_that_keeps_growing_is_collected_before_the_ten_minutes(frozen_state):
    """Cycles that became garbage after being frozen wait for the full collection; a flood of them
    (say a stream of bad requests) grows the heap and triggers it early rather than growing it for
    ten minutes."""
    now = [0.0]
    pacer = GcPacer(full_seconds=600.0, clock=lambda: now[0], min_blocks=1)
    now[0] = 600.0
    pacer.tick()  # a full collection: the limit is GROWTH x the heap now
    assert pacer.full_collections == 1
    assert pacer.blocks_limit >= 2 * sys.getallocatedblocks() - 10_000
    now[0] = 601.5
    pacer.tick()
    assert pacer.full_collections == 1  # no growth, no collection
    pacer.blocks_limit = sys.getallocatedblocks() + 20_000  # a small heap's limit, without a huge flood
    gc.disable()  # the flood must reach the permanent generation (young cycles are collected as usual)
    try:
        flood = [_cycle() for _ in range(20_000)]  # at least 2 blocks each
        pacer.tick()  # freezes the flood (the size was just read: it is read GROWTH_CHECK_SECONDS apart)
    finally:
        gc.enable()
    gc.collect()  # the flood is garbage, but frozen: no ordinary collection frees it
    assert pacer.full_collections == 1 and flood[0]() is not None
    now[0] = 603.0
    pacer.tick()  # over the limit, long before ten minutes
    assert pacer.full_collections == 2 and flood[0]() is None
