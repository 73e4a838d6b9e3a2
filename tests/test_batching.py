"""Micro-batching of draft calls (batching.py): concurrent submits become one batched call, each
caller gets its own answer or the call's error. A fake call stands in for the gRPC stub."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specmesh_services.router.batching import MicroBatcher
from specmesh_services.router.pipeline import micro_batches, split


class FakeService:
    def __init__(self, fail: Exception | None = None, delay: float = 0.0) -> None:
        self.requests: list[list[int]] = []
        self.fail, self.delay = fail, delay

    async def __call__(self, request, timeout):
        self.requests.append(list(request))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise self.fail
        return SimpleNamespace(trees=[x * 10 for x in request])


async def submit(batcher: MicroBatcher, item, alone: bool = False):
    """The item's answer, without its time."""
    return (await batcher.submit_timed(item, 1.0, alone))[0]


def test_items_submitted_together_go_in_one_call_and_answers_go_back_in_order():
    async def run():
        service = FakeService()
        batcher = MicroBatcher(service, list, max_items=64)
        answers = await asyncio.gather(*(submit(batcher, i) for i in range(5)))
        later = await submit(batcher, 7)
        return service, answers, later
    service, answers, later = asyncio.run(run())
    assert answers == [0, 10, 20, 30, 40] and later == 70
    assert service.requests == [[0, 1, 2, 3, 4], [7]]


def test_a_full_batch_is_sent_at_once():
    async def run():
        service = FakeService()
        batcher = MicroBatcher(service, list, max_items=2)
        await asyncio.gather(*(submit(batcher, i) for i in range(5)))
        return service.requests
    assert asyncio.run(run()) == [[0, 1], [2, 3], [4]]


def test_items_ready_together_go_out_in_micro_batches_in_order():
    async def run():
        service = FakeService()
        batcher = MicroBatcher(service, list, max_items=64, parts=lambda n: 3 if n > 4 else 1)
        answers = await asyncio.gather(*(submit(batcher, i) for i in range(7)))
        return service.requests, answers
    requests, answers = asyncio.run(run())
    assert requests == [[0, 1, 2], [3, 4], [5, 6]] and answers == [10 * i for i in range(7)]


def pass_seconds(intercept: float, per_row: float):
    return lambda rows: intercept + per_row * rows


@pytest.mark.parametrize("items,rows,cost,parts", [
    (8, 5, None, 1),                            # nothing measured yet: whole
    (1, 5, pass_seconds(0.05, 0.01), 1),        # nothing to split
    (8, 5, pass_seconds(0.0, 0.01), 8),         # cost per row only: every split is free
    (8, 5, pass_seconds(0.4, 0.01), 1),         # a large intercept: even two passes drop > 10%
    (8, 5, pass_seconds(0.02, 0.01), 3),        # (0.42)/(m 0.02 + 0.4) >= 0.9 up to m = 3
])
def test_spins_heuristic_splits_while_throughput_holds(items, rows, cost, parts):
    assert micro_batches(items, rows, cost) == parts
    if cost is not None and parts > 1:  # brute force over the throughput of each split
        whole = cost(items * rows)
        holds = [m for m in range(2, items + 1) if whole / (m * cost(items * rows / m)) >= 0.9]
        assert parts == max(holds)


def test_split_keeps_the_order_and_puts_the_larger_runs_first():
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([1, 2], 5) == [[1], [2]] and split([1, 2, 3], 1) == [[1, 2, 3]]


def test_every_caller_gets_the_calls_error():
    async def run():
        batcher = MicroBatcher(FakeService(fail=TimeoutError("slow")), list)
        return await asyncio.gather(*(submit(batcher, i) for i in range(3)),
                                    return_exceptions=True)
    errors = asyncio.run(run())
    assert all(isinstance(e, TimeoutError) for e in errors)


def test_a_cancelled_caller_does_not_break_the_others():
    async def run():
        service = FakeService(delay=0.05)
        batcher = MicroBatcher(service, list)
        a = asyncio.ensure_future(submit(batcher, 1))
        b = asyncio.ensure_future(submit(batcher, 2))
        await asyncio.sleep(0)
        a.cancel()
        return await b, service.requests
    answer, requests = asyncio.run(run())
    assert answer == 20 and requests == [[2]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        MicroBatcher(FakeService(), list, max_items=0)


def test_timed_submits_get_their_share_of_the_service_time():
    async def run():
        service = FakeService()
        batcher = MicroBatcher(service, list, seconds=lambda response, n: [0.5 / n] * n)
        timed = await asyncio.gather(*(batcher.submit_timed(i, 1.0) for i in range(4)))
        untimed = await MicroBatcher(service, list).submit_timed(3, 1.0)
        return timed, untimed
    timed, untimed = asyncio.run(run())
    assert timed == [(0, 0.125), (10, 0.125), (20, 0.125), (30, 0.125)]
    assert untimed == (30, 0.0)


def test_a_caller_alone_sends_at_once_and_gets_the_answer_or_the_error():
    async def run(service, alone=True):
        batcher = MicroBatcher(service, list)
        loop = asyncio.get_running_loop()
        turns = 0

        def tick():  # counts event-loop turns until the answer
            nonlocal turns
            turns += 1
            loop.call_soon(tick)
        loop.call_soon(tick)
        try:
            return await submit(batcher, 3, alone), service.requests, turns
        except TimeoutError as err:
            return err, service.requests, turns
    answer, requests, turns = asyncio.run(run(FakeService()))
    assert answer == 30 and requests == [[3]]
    # only the fake service's own sleep(0) yields (batched: three turns more)
    assert turns == 1 and asyncio.run(run(FakeService(), alone=False))[2] == 4
    error, requests, _ = asyncio.run(run(FakeService(fail=TimeoutError("slow"))))
    assert isinstance(error, TimeoutError) and requests == [[3]]
