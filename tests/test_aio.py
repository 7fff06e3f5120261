"""lipstream.aio.wait_for: a caller's cancellation always ends the wait (Python 3.11's asyncio.wait_for can
swallow one that comes as the awaited thing finishes: CPython issue 86296)."""

import asyncio

import pytest

from lipstream.aio import wait_for


def test_a_cancellation_that_meets_a_finished_wait_is_not_swallowed():
    async def waiter(done: asyncio.Task) -> str:
        asyncio.current_task().cancel()  # cancelled as it starts waiting on something already finished
        await wait_for(done, timeout=10)
        return "carried on"  # asyncio.wait_for on 3.11 gets here: the cancellation is lost

    async def main() -> None:
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(waiter(done))

    asyncio.run(main())


def test_a_wait_gives_the_result_or_times_out():
    async def main() -> None:
        event = asyncio.Event()
        with pytest.raises(TimeoutError):
            await wait_for(event.wait(), 0.05)
        asyncio.get_running_loop().call_later(0.01, event.set)
        assert await wait_for(event.wait(), 5.0) is True

    asyncio.run(main())
