"""Stopping the background loops of a service (the verifier's pool loops, the router's result
dispatcher) for sure.

One `Task.cancel()` is not enough on Python 3.11: `asyncio.wait_for` drops a cancellation that
lands as its inner call completes, and redis-py sends every command through `wait_for`, so a
loop cancelled while a Redis command is on the wire goes on (docs/reliability.md, Drain on
SIGTERM). `stop` cancels again until the tasks have ended; and since under load the read and
the cancel land together every time, the Redis pool also ends a task being stopped after each
command (`stopping`).
"""
import asyncio
import logging
import weakref
from collections.abc import Iterable

log = logging.getLogger(__name__)

RECANCEL_S = 0.05  # how long a cancelled task gets before it is cancelled again
_STOPPING: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()


def stopping() -> bool:
    """Whether the running task is one `stop` is stopping (a library may have swallowed its
    cancellation): a command wrapper then raises CancelledError itself."""
    task = asyncio.current_task()
    return task is not None and task in _STOPPING


async def stop(tasks: Iterable[asyncio.Task]) -> None:
    """Cancels `tasks` and waits until every one has ended, cancelling again the ones whose
    cancellation a library call swallowed."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    _STOPPING.update(pending)
    rounds = 0
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        rounds += 1
        if pending and rounds % 100 == 0:  # every 5 s: a loop that never ends is a bug
            log.warning("still stopping %s", ", ".join(sorted(t.get_name() for t in pending)))
    for task in tasks:  # retrieved, so that asyncio does not log "never retrieved"
        if not task.cancelled():
            task.exception()
