"""The engine thread: wait for work, serve resync requests, step, hand each step's batch to the pusher.

torch releases the GIL in its kernels, so this thread and the gRPC event loop run side by side.
Resyncs run here, between steps, so a resync batch is ordered correctly against the step batches.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from services.scheduler.rpc.pusher import DetokenizerPusher
from services.scheduler.core.engine import Engine
from services.scheduler.core.outputs import ReqOutput
from services.scheduler.rpc.servicer import step_batch_pb

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


class EngineLoop:
    def __init__(self, engine: Engine, pusher: DetokenizerPusher,
                 on_step: Callable[[list[ReqOutput]], None] | None = None) -> None:
        self.engine = engine
        self.pusher = pusher
        self.on_step = on_step
        self._resyncs: list[str | None] = []   # owners to resync; None = everything (reconnect)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request_resync(self, owner: str | None) -> None:
        with self._lock:
            self._resyncs.append(owner)
        self.engine.wake()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.engine.wake()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine, pusher = self.engine, self.pusher
        while not self._stop.is_set():
            with self._lock:
                resyncs, self._resyncs = self._resyncs, []
            for owner in resyncs:
                outs = engine.resync(owner)
                pusher.push(step_batch_pb(outs, resync=True), resync=owner is None)
                log.info("resync sent owner=%s requests=%d", owner or "*", len(outs))
            if not engine.wait_for_work(IDLE_WAIT_S):
                continue
            try:
                outs = engine.step()
            except Exception:  # a bug must not leave the service up with a dead engine: exit, get restarted
                log.exception("engine step failed; exiting")
                logging.shutdown()
                os._exit(1)
            if outs:
                pusher.push(step_batch_pb(outs))
            if self.on_step is not None:
                self.on_step(outs)
