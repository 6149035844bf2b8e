"""Whether a coroutine lets the event loop run other work while it goes on (the sidecar's loop answers the
ranks' posts between the slices of its long passes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def run_beside_other_work(work: Callable[[], Awaitable[T]], turns: list) -> T:
    """asyncio.run(work()) with another task beside it that appends to `turns` at every turn of the loop it
    gets: none while `work` never yields."""

    async def both() -> T:
        async def other() -> None:
            while True:
                turns.append(1)
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        try:
            return await work()
        finally:
            task.cancel()

    return asyncio.run(both())
