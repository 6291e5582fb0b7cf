"""in_own_thread: the engine's work off the engine thread runs in a thread that has ended (and taken its
OpenMP team with it) by the time the caller has the result."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from services.scheduler.rpc.own_thread import in_own_thread


def test_returns_the_result_from_a_thread_that_has_ended() -> None:
    ran_on: list[threading.Thread] = []

    def work(a: int, b: int) -> int:
        ran_on.append(threading.current_thread())
        return a + b

    async def main() -> int:
        return await in_own_thread(work, 2, 3)

    assert asyncio.run(main()) == 5
    assert ran_on[0] is not threading.main_thread() and not ran_on[0].is_alive()


def test_raises_what_the_function_raised() -> None:
    def work() -> None:
        raise ValueError("bad adapter")

    async def main() -> None:
        await in_own_thread(work)

    with pytest.raises(ValueError, match="bad adapter"):
        asyncio.run(main())


def test_a_cancelled_wait_leaves_the_function_to_finish() -> None:
    release, finished = threading.Event(), threading.Event()

    def work() -> str:
        release.wait(30)
        finished.set()
        return "done"

    async def main() -> None:
        task = asyncio.create_task(in_own_thread(work))
        await asyncio.sleep(0)  # the thread is started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # at once: it does not wait for the function
        assert not finished.is_set()
        release.set()
        await asyncio.to_thread(finished.wait, 30)
        await asyncio.sleep(0)  # its result is dropped without an error on the loop

    asyncio.run(main())
    assert finished.is_set()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="libgomp starts no team on one CPU")
def test_torch_openmp_workers_do_not_outlive_the_call() -> None:
    """The OpenMP workers a parallel torch op starts are gone afterwards, where asyncio.to_thread's
    pool thread keeps its team (the libgomp behaviour that made the forward's workers sleep)."""
    script = textwrap.dedent("""
        import asyncio, os, time, torch
        from services.scheduler.rpc.own_thread import in_own_thread

        def parallel_op():
            # A new thread's OpenMP default: a team of one thread per CPU. (Not torch.set_num_threads,
            # which also starts a pool of its own, pthreadpool's, that lives on.)
            torch.ones(1 << 22).add_(1)  # far above ATen's grain size: a parallel region

        def threads():
            return len(os.listdir("/proc/self/task"))

        def settled(want, deadline_s=20.0):
            # libgomp releases a freed team's workers and they exit on their own, detached: no event
            # says when they are gone, so the count is read until it is down (or the deadline).
            end = time.monotonic() + deadline_s
            while threads() > want and time.monotonic() < end:
                time.sleep(0.01)
            return threads()

        async def main():
            await asyncio.to_thread(lambda: None)  # the pool's first thread, before counting
            before = threads()
            await in_own_thread(parallel_op)
            own = settled(before) - before
            await asyncio.to_thread(parallel_op)
            pool = threads() - before
            names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
            print(own, pool, ",".join(names))

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), check=True).stdout.split()
    own, pool = int(out[0]), int(out[1])
    assert own == 0, f"threads left after in_own_thread: {out[2]}"
    assert pool >= 1  # the control: the pool thread keeps its team's worker


# Calls the scheduler may hand to asyncio's pool threads (they run no torch op): the rest of the
# engine's work off its own thread goes through in_own_thread.
POOL_SAFE = {"engine.wait_idle", "thread.join"}


def test_the_scheduler_hands_no_model_work_to_pool_threads() -> None:
    """A model operation run on a pool thread would leave an OpenMP team behind for the rest of the
    process (every later decode step's workers then sleep at each barrier: the slowdown in_own_thread
    exists for), and nothing else would fail: so every asyncio.to_thread / run_in_executor call in the
    scheduler's code must name a call of POOL_SAFE."""
    root = Path(__file__).resolve().parents[2] / "services" / "scheduler"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr == "to_thread" and node.args:
                target = node.args[0]
            elif node.func.attr == "run_in_executor" and len(node.args) > 1:
                target = node.args[1]
            else:
                continue
            found.append((path.relative_to(root).as_posix(), ast.unparse(target)))
    assert found, "the scan found no call at all: it no longer sees the code"
    assert [f for f in found if f[1] not in POOL_SAFE] == []
