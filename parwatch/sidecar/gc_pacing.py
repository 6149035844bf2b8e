"""The cyclic garbage collector, paced for a working set that is replaced every second.

Each second brings about one summary per rank, which lives until that rank's next one: at 1,024
ranks some 50,000 GC-tracked objects (pydantic models, instance lists) that are all young when a
collection starts. A generation-0 collection then walks every one of them with the event loop
stopped: 34-80 ms, measured with gc callbacks during benchmarks/sidecar_load.py, and the largest
part of its ingest p99. Reference counting frees all of this garbage; the cyclic collector only
matters for cycles, which the sidecar rarely makes.

So `GcPacer.tick`, every FREEZE_SECONDS: what is alive moves to the permanent generation
(`gc.freeze`, constant time), so no collection walks more than that long's survivors; and every
FULL_SECONDS, or sooner once the heap has grown to GROWTH x its size after the last full collection
(cycles that became garbage after being frozen stay there until then: a flood of them must not grow
the heap for ten minutes), it is given back and collected in full: one pause per FULL_SECONDS
(about 170 ms over a 1,024-rank sidecar's heap, measured in process) instead of several of 34-80 ms
a minute.

The heap's size is read as `sys.getallocatedblocks()` (pymalloc walks its arenas, not the objects:
0.07 ms at 340,000 blocks). `gc.get_freeze_count()` walks the permanent generation's list: it was
read every 10 s and cost 27 ms of event loop each time on a 1,024-rank sidecar (py-spy, 2026-12-01).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

log = logging.getLogger(__name__)

FREEZE_SECONDS = 0.1
FULL_SECONDS = 600.0
GROWTH = 2.0
GROWTH_CHECK_SECONDS = 1.0
"""How often the heap's size is read."""
MIN_BLOCKS = 2_000_000
"""The heap may grow to max(GROWTH x its allocated blocks after a full collection, this): a 1,024-rank
sidecar holds about 500,000 blocks (measured in process), so growing into its working set never triggers it."""


class GcPacer:
    def __init__(self, full_seconds: float = FULL_SECONDS, clock=time.monotonic, min_blocks: int = MIN_BLOCKS):
        self.full_seconds, self.clock, self.min_blocks = full_seconds, clock, min_blocks
        self.last_full = self.last_check = clock()
        self.blocks_limit = max(int(GROWTH * sys.getallocatedblocks()), min_blocks)
        self.full_collections = 0
        self.full_pause_seconds = 0.0
        """The last full collection's pause."""

    def tick(self) -> None:
        now = self.clock()
        due = now - self.last_full >= self.full_seconds
        if not due and now - self.last_check >= GROWTH_CHECK_SECONDS:
            self.last_check = now
            due = sys.getallocatedblocks() > self.blocks_limit
        if due:
            start = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            self.full_pause_seconds = time.perf_counter() - start
            self.full_collections += 1
            self.last_full = now
            log.debug("full collection: %d unreachable objects, %.1f ms", freed, self.full_pause_seconds * 1e3)
            gc.freeze()
            self.blocks_limit = max(int(GROWTH * sys.getallocatedblocks()), self.min_blocks)
            return
        gc.freeze()

    async def run(self, every: float = FREEZE_SECONDS) -> None:
        while True:
            await asyncio.sleep(every)
            self.tick()
