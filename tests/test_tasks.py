"""Stopping background loops: a loop whose cancellation a library call swallowed is cancelled
again until it ends (services/common/tasks.py), also a loop of real Redis commands, which on
Python 3.11 loses most single cancels."""
import asyncio

from specmesh_services.common import tasks
from specmesh_services.common.pool.redis import RedisPool


def test_a_loop_that_swallows_its_first_cancellations_is_stopped():
    async def run():
        swallowed = 0

        async def stubborn():
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if swallowed == 3:
                        raise
                    swallowed += 1  # what asyncio.wait_for does on 3.11 in a narrow window

        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        await asyncio.wait_for(tasks.stop([task]), timeout=5)
        assert task.cancelled() and swallowed == 3
    asyncio.run(run())


def test_loops_of_redis_commands_stop_every_time(redis_url):
    async def run():
        pool = RedisPool(redis_url, prefix="stop-loops")
        abandoned = False

        async def loop():
            while not abandoned:
                await pool.pending()

        try:
            for round_ in range(40):
                task = asyncio.create_task(loop(), name=f"loop-{round_}")
                await asyncio.sleep(0.001 * (round_ % 4))
                try:
                    await asyncio.wait_for(tasks.stop([task]), timeout=5)
                except TimeoutError:
                    abandoned = True
                    await task
                    raise AssertionError(f"round {round_}: the loop went on after its cancel")
        finally:
            await pool.close()
    asyncio.run(run())


def test_stopping_nothing_and_ended_tasks_returns():
    async def boom():
        raise ValueError("failed before it was stopped")

    async def run():
        done = asyncio.create_task(asyncio.sleep(0))
        failed = asyncio.create_task(boom())
        await asyncio.wait([done, failed])
        await asyncio.wait_for(tasks.stop([]), timeout=1)
        await asyncio.wait_for(tasks.stop([done, failed]), timeout=1)
    asyncio.run(run())
