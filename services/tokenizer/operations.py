"""Server operations fanned out to every scheduler: abort all, pause / continue, weight update,
profiling (the tokenizer's side of InferenceService's control RPCs, as FlushCache is).

Every scheduler must take part: one that is down makes the call fail (UNAVAILABLE naming it) rather
than leave the server half paused or half updated without saying so. Each call has a deadline, so
none can hang a client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from ringserve.errors import InvalidArgument, Unavailable, error_for_status
from ringserve.v1 import api_pb2, scheduler_pb2

from .scheduler_client import SchedulerConnection, SchedulerPool

log = logging.getLogger(__name__)

T = TypeVar("T")
CONTROL_TIMEOUT_S = 60.0
UPDATE_TIMEOUT_S = 900.0      # draining running requests, then loading the weights
PAUSE_MODES = {"": scheduler_pb2.PAUSE_MODE_ABORT, "abort": scheduler_pb2.PAUSE_MODE_ABORT,
               "retract": scheduler_pb2.PAUSE_MODE_RETRACT, "in_place": scheduler_pb2.PAUSE_MODE_IN_PLACE}


class SchedulerOps:
    def __init__(self, pool: SchedulerPool) -> None:
        self.pool = pool

    async def _all(self, call: Callable[[SchedulerConnection], Awaitable[T]]) -> list[T]:
        conns = list(self.pool.conns.values())
        down = [c.address for c in conns if not c.connected]
        if down or not conns:
            raise Unavailable("scheduler(s) unavailable: " + (", ".join(down) or "none configured"))
        try:
            return list(await asyncio.gather(*(call(c) for c in conns)))
        except grpc.aio.AioRpcError as e:
            raise error_for_status(e.code(), e.details() or e.code().name) from None

    async def abort_all(self, message: str) -> int:
        resps = await self._all(lambda c: c.stub.AbortAll(scheduler_pb2.AbortAllRequest(message=message),
                                                          timeout=CONTROL_TIMEOUT_S))
        return sum(r.num_aborted for r in resps)

    async def pause(self, mode: str) -> int:
        pb_mode = PAUSE_MODES.get(mode)
        if pb_mode is None:
            raise InvalidArgument("mode", f"{mode!r} is not one of abort, retract, in_place")
        sreq = scheduler_pb2.SchedulerServicePauseGenerationRequest(mode=pb_mode)
        resps = await self._all(lambda c: c.stub.PauseGeneration(sreq, timeout=CONTROL_TIMEOUT_S))
        for c in self.pool.conns.values():
            c.paused = mode or "abort"
        return sum(r.num_requests for r in resps)

    async def resume(self) -> None:
        await self._all(lambda c: c.stub.ContinueGeneration(scheduler_pb2.SchedulerServiceContinueGenerationRequest(),
                                                            timeout=CONTROL_TIMEOUT_S))
        for c in self.pool.conns.values():
            c.paused = ""

    def paused(self) -> str:
        return next((c.paused for c in self.pool.conns.values() if c.paused), "")

    async def update_weights(self, req: api_pb2.UpdateWeightsFromDiskRequest) -> api_pb2.UpdateWeightsFromDiskResponse:
        if not req.model_path:
            raise InvalidArgument("model_path", "required")
        sreq = scheduler_pb2.SchedulerServiceUpdateWeightsFromDiskRequest(
            model_path=req.model_path, load_format=req.load_format, abort_all_requests=req.abort_all_requests,
            weight_version=req.weight_version)

        async def one(c: SchedulerConnection) -> scheduler_pb2.SchedulerServiceUpdateWeightsFromDiskResponse:
            resp = await c.stub.UpdateWeightsFromDisk(sreq, timeout=UPDATE_TIMEOUT_S)
            if resp.success:
                c.weight_version = resp.weight_version
            return resp

        resps = await self._all(one)
        failed = [f"{c}: {r.message}" for c, r in zip(self.pool.conns, resps) if not r.success]
        ok = not failed
        version = resps[0].weight_version if resps else ""
        message = resps[0].message if ok and resps else "; ".join(failed)
        log.info("weight update from %s: success=%s %s", req.model_path, ok, message)
        return api_pb2.UpdateWeightsFromDiskResponse(success=ok, message=message, weight_version=version,
                                                     num_paused_requests=sum(r.num_paused_requests for r in resps))

    async def start_profile(self, req: api_pb2.StartProfileRequest) -> str:
        sreq = scheduler_pb2.SchedulerServiceStartProfileRequest(
            output_dir=req.output_dir, activities=req.activities, with_stack=req.with_stack,
            record_shapes=req.record_shapes, profile_prefix=req.profile_prefix)
        if req.HasField("num_steps"):
            sreq.num_steps = req.num_steps
        resps = await self._all(lambda c: c.stub.StartProfile(sreq, timeout=CONTROL_TIMEOUT_S))
        return "; ".join(r.message for r in resps)

    async def stop_profile(self) -> list[str]:
        resps = await self._all(lambda c: c.stub.StopProfile(scheduler_pb2.SchedulerServiceStopProfileRequest(),
                                                             timeout=CONTROL_TIMEOUT_S))
        return [f for r in resps for f in r.trace_files]

