"""asyncio's wait_for as Python 3.12 has it, for 3.11.

On 3.11 `asyncio.wait_for` can swallow its caller's cancellation when what it awaits finishes in the same
moment (CPython issue 86296, fixed by 3.12's rewrite on `asyncio.timeout`). A loop that waits that way every
frame then outlives its cancellation: AvatarRunner's aclose() waited forever on a room's video task that
kept iterating its session. `asyncio.timeout` (3.11+) tells its own cancellation from the caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """What `awaitable` gives, or TimeoutError after `timeout` seconds (None: no limit); a cancellation of
    the caller always ends it."""
    async with asyncio.timeout(timeout):
        return await awaitable
