"""A server coroutine on its own event loop in a thread, for module-scoped fixtures that serve an
embedded mesh over real gRPC or HTTP while the tests call it synchronously."""
import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future


@contextlib.contextmanager
def served(serve: Callable[[Callable[[object], None], asyncio.Event], Awaitable[None]],
           timeout: float = 600) -> Iterator[object]:
    """Runs `serve(publish, stop)` in a thread: it calls publish(value) once it serves, then
    awaits stop.wait() and shuts down. Yields the value; a failure before publish is raised."""
    value: Future = Future()
    stopper: Future = Future()

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        stopper.set_result(lambda: loop.call_soon_threadsafe(stop.set))
        await serve(value.set_result, stop)

    def run():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting fixture
            if not value.done():
                value.set_exception(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield value.result(timeout=timeout)
    finally:
        if stopper.done():
            stopper.result()()
        thread.join(timeout=60)
