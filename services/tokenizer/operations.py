"""Server operations fanned out to every scheduler: abort all, pause / continue, weight update,
profiling, LoRA adapters (the tokenizer's side of InferenceService's control RPCs, as FlushCache is).

Every scheduler must take part: one that is down makes the call fail (UNAVAILABLE naming it) rather
than leave the server half paused or half updated without saying so. Each call has a deadline, so
none can hang a client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from ringserve.errors import AlreadyExists, InvalidArgument, Unavailable, error_for_status
from ringserve.message import LoraAdapter
from ringserve.v1 import api_pb2, scheduler_pb2

from .lora import LoraRegistry
from .scheduler_client import SchedulerConnection, SchedulerPool

log = logging.getLogger(__name__)

T = TypeVar("T")
CONTROL_TIMEOUT_S = 60.0
UPDATE_TIMEOUT_S = 900.0      # draining running requests, then loading the weights
LORA_LOAD_TIMEOUT_S = 300.0   # reading an adapter's files
UNLOAD_WAIT_S = 600.0         # for the requests using an adapter, by default
PAUSE_MODES = {"": scheduler_pb2.PAUSE_MODE_ABORT, "abort": scheduler_pb2.PAUSE_MODE_ABORT,
               "retract": scheduler_pb2.PAUSE_MODE_RETRACT, "in_place": scheduler_pb2.PAUSE_MODE_IN_PLACE}


class SchedulerOps:
    def __init__(self, pool: SchedulerPool) -> None:
        self.pool = pool
        self._tasks: set[asyncio.Task[None]] = set()  # adapters being sent to a scheduler that lacks them

    def _up(self) -> list[SchedulerConnection]:
        conns = list(self.pool.conns.values())
        down = [c.address for c in conns if not c.connected]
        if down or not conns:
            raise Unavailable("scheduler(s) unavailable: " + (", ".join(down) or "none configured"))
        return conns

    async def _all(self, call: Callable[[SchedulerConnection], Awaitable[T]]) -> list[T]:
        conns = self._up()
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


    # -- LoRA adapters (the registry: lora.py) ---------------------------------------------------

    async def load_lora(self, registry: LoraRegistry, adapter: LoraAdapter, served_model_name: str) -> None:
        """On every scheduler, then into the registry. Where some schedulers loaded it and another
        refused, those unload it again: every scheduler holds the same set."""
        if not adapter.name:
            raise InvalidArgument("lora_name", "required")
        if not adapter.path:
            raise InvalidArgument("lora_path", "required")
        if adapter.name == served_model_name:
            raise InvalidArgument("lora_name", f"{adapter.name!r} is the served model's name")
        if adapter.name in registry.adapters or adapter.name in registry.loading:
            raise AlreadyExists(f"lora_name: adapter {adapter.name!r} is already loaded; unload it first")
        conns = self._up()
        registry.loading.add(adapter.name)
        try:
            sreq = scheduler_pb2.SchedulerServiceLoadLoraAdapterRequest(adapter=adapter.to_pb())
            results = await asyncio.gather(*(c.stub.LoadLoraAdapter(sreq, timeout=LORA_LOAD_TIMEOUT_S) for c in conns),
                                           return_exceptions=True)
            errors = [(c, r) for c, r in zip(conns, results) if isinstance(r, BaseException)]
            if errors:
                done = [c for c, r in zip(conns, results) if not isinstance(r, BaseException)]
                await self._unload_on(done, adapter.name)
                _, err = errors[0]
                if isinstance(err, grpc.aio.AioRpcError):
                    raise error_for_status(err.code(), err.details() or err.code().name) from None
                raise err
            registry.add(adapter)
        finally:
            registry.loading.discard(adapter.name)
        log.info("lora adapter %s loaded from %s on %d scheduler(s)", adapter.name, adapter.path, len(conns))

    async def unload_lora(self, registry: LoraRegistry, name: str, wait_s: float = 0.0) -> None:
        """Out of the registry at once, then (once no request of ours uses it) off every scheduler."""
        if not name:
            raise InvalidArgument("lora_name", "required")
        registry.remove(name)
        log.info("lora adapter %s: unloading (new requests refused; %d in use)", name, registry.in_use[name])
        await registry.wait_unused(name, wait_s or UNLOAD_WAIT_S)
        await self._unload_on(self._up(), name)
        log.info("lora adapter %s unloaded", name)

    async def _unload_on(self, conns: list[SchedulerConnection], name: str) -> None:
        sreq = scheduler_pb2.SchedulerServiceUnloadLoraAdapterRequest(lora_name=name)

        async def one(c: SchedulerConnection) -> None:
            try:
                await c.stub.UnloadLoraAdapter(sreq, timeout=CONTROL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:  # gone already (a restart): the goal is met
                    raise error_for_status(e.code(), f"scheduler {c.address}: {e.details()}") from None

        await asyncio.gather(*(one(c) for c in conns))

    def sync_lora(self, registry: LoraRegistry, conn: SchedulerConnection, adapters: list[LoraAdapter]) -> None:
        """A scheduler (re)connected holding `adapters`: the ones the registry lacks join it (its
        --lora-paths), and it is sent the ones it lacks (it restarted, or joined after a load)."""
        have = {a.name for a in adapters}
        for a in adapters:
            if a.name not in registry.adapters:
                registry.add(a)
                log.info("lora adapter %s (from %s) registered from scheduler %s", a.name, a.path, conn.address)
                for other in self.pool.conns.values():  # the others get it too (their flags may differ)
                    if other is not conn and other.connected:
                        self._spawn(self._push(other, a))
        for a in registry.listing():
            if a.name not in have:
                self._spawn(self._push(conn, a))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push(self, conn: SchedulerConnection, adapter: LoraAdapter) -> None:
        sreq = scheduler_pb2.SchedulerServiceLoadLoraAdapterRequest(adapter=adapter.to_pb())
        try:
            await conn.stub.LoadLoraAdapter(sreq, timeout=LORA_LOAD_TIMEOUT_S)
            log.info("lora adapter %s sent to scheduler %s", adapter.name, conn.address)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                log.error("lora adapter %s: scheduler %s could not load it: %s", adapter.name, conn.address,
                          e.details())
