"""The engine's work off the engine thread (loading, warming up, control operations) runs in a thread of
its own that ends with it, never on asyncio's pool threads, which live on.

torch's OpenMP runtime (libgomp) gives every thread that starts a parallel region a team of worker
threads, kept until that thread exits, and counts the threads of all teams. While they outnumber the
CPUs it all but stops spinning at its barriers (a hundred spins, then a futex sleep), so the
forward's workers sleep after each of a decode step's hundreds of parallel regions and wait to be
woken for the next. A model loaded and warmed up on a thread that stays alive did that to every later
step: the default model in bf16, 64 rows, 2 cores, steps on a second thread: 122-138 ms a decode step
with the loading thread alive, 57-59 with it ended, 62 with load and steps on one thread. Served
(workload B through the gRPC API, two alternating pairs): 313-333 -> 492-508 output tok/s, decode
steps 100-107 -> 64-65 ms; the scheduler used 134 % CPU before, 185 % after (one run each).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a new thread, awaited like asyncio.to_thread; returns once that thread has ended
    (its OpenMP team freed). Cancelling the await does not stop fn: it runs to its end, unheard."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]  # T when error is None

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task, as to_thread does
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=work, name=f"own-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():  # (cancelling the await cancels `done`: then fn may still be running)
            await asyncio.to_thread(thread.join)
