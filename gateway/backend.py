"""The gateway's one gRPC channel to the tokenizer's InferenceService, and the calls it makes.

Generations go over a few long-lived GenerateStream calls (gateway.multiplex), taken in turn, so
that a busy gateway sends and receives one message per step instead of one per token per request;
with `streams=0` each request is its own Generate call. Every call fails fast (no wait_for_ready):
while the tokenizer is away the client gets a 503 at once instead of a request that hangs. A
generation closed early (the HTTP client went away) is cancelled, which makes the tokenizer abort
the request at the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import from_rpc
from gateway.multiplex import GenerateMux
from ringserve.grpc_server import client_channel
from ringserve.tls import TlsConfig
from ringserve.v1 import api_pb2 as pb
from ringserve.v1 import api_pb2_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 10.0  # unary info calls; generation has no deadline (outputs can be long)
CONTROL_TIMEOUT_S = 960.0  # operations: a weight update waits for running requests, then loads


class Backend:
    def __init__(self, target: str, tls: TlsConfig | None = None, streams: int = 2) -> None:
        self.target = target
        self.channel = client_channel(target, tls)
        self.stub = api_pb2_grpc.InferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._model_info: pb.GetModelInfoResponse | None = None
        self._muxes: list[GenerateMux | None] = [None] * streams
        self._turn = 0
        self._opened = 0

    async def close(self) -> None:
        for mux in self._muxes:
            if mux is not None:
                await mux.close()
        await self.channel.close()

    def _mux(self) -> GenerateMux:
        """The next stream in turn, reopened if it broke (a new call may reach another replica)."""
        i = self._turn % len(self._muxes)
        self._turn += 1
        mux = self._muxes[i]
        if mux is None or not mux.alive:
            self._opened += 1
            mux = self._muxes[i] = GenerateMux(self.stub, f"generate stream {self._opened}")
            log.info("%s opened to %s", mux.name, self.target)
        return mux

    def generate(self, req: pb.GenerateRequest,
                 param_map: dict[str, str] | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """The tokenizer's messages for req, as an async generator that sends nothing before its first
        read; closing it early cancels the request. A failed call raises GatewayError (mapped status)."""
        # Returned as is, not wrapped: every layer costs a resume per streamed chunk.
        if not self._muxes:
            return self._generate_call(req, param_map)
        return self._mux().generate(req, param_map)

    async def _generate_call(self, req: pb.GenerateRequest,
                             param_map: dict[str, str] | None = None) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(req)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            log.info("rid=%s generate failed: %s %s", req.rid, e.code().name, e.details())
            raise from_rpc(e, param_map) from None
        finally:
            # No-op when the call already ended; otherwise (client gone, generator closed) the
            # tokenizer sees the cancel and aborts the request at the scheduler.
            if call.cancel():
                log.info("rid=%s cancelled (client went away)", req.rid)

    async def _unary(self, method: str, req: object, timeout: float = INFO_TIMEOUT_S,
                     wait_for_ready: bool = False) -> object:
        try:
            return await getattr(self.stub, method)(req, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e) from None

    async def model_info(self, wait_s: float | None = None) -> pb.GetModelInfoResponse:
        """Cached after the first success (the model cannot change under a running tokenizer; a weight
        update through this gateway drops it, for weight_version)."""
        if self._model_info is None:
            if wait_s is not None:
                info = await self._unary("GetModelInfo", pb.GetModelInfoRequest(), wait_s, True)
            else:
                info = await self._unary("GetModelInfo", pb.GetModelInfoRequest())
            assert isinstance(info, pb.GetModelInfoResponse)
            self._model_info = info
        return self._model_info

    async def fresh_model_info(self) -> pb.GetModelInfoResponse:
        info = await self._unary("GetModelInfo", pb.GetModelInfoRequest())
        assert isinstance(info, pb.GetModelInfoResponse)
        self._model_info = info
        return info

    async def server_info(self) -> pb.GetServerInfoResponse:
        resp = await self._unary("GetServerInfo", pb.GetServerInfoRequest())
        assert isinstance(resp, pb.GetServerInfoResponse)
        return resp

    async def flush_cache(self) -> pb.FlushCacheResponse:
        resp = await self._unary("FlushCache", pb.FlushCacheRequest())
        assert isinstance(resp, pb.FlushCacheResponse)
        return resp

    async def abort(self, rid: str) -> bool:
        resp = await self._unary("Abort", pb.AbortRequest(rid=rid))
        assert isinstance(resp, pb.AbortResponse)
        return resp.found

    async def control(self, method: str, req: object, timeout: float = CONTROL_TIMEOUT_S) -> object:
        """An operation RPC (abort all, pause, continue, weight update, profiling, load)."""
        if method in ("UpdateWeightsFromDisk", "LoadLoraAdapter", "UnloadLoraAdapter"):
            self._model_info = None  # weight_version / the adapters (models) change
        return await self._unary(method, req, timeout)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        resp = await self._unary("Detokenize", pb.DetokenizeRequest(ids=ids, skip_special_tokens=skip_special_tokens))
        assert isinstance(resp, pb.DetokenizeResponse)
        return resp.text

    async def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        resp = await self._unary("Tokenize", req)
        assert isinstance(resp, pb.TokenizeResponse)
        return resp

    async def serving(self) -> bool:
        """True only when the tokenizer says SERVING on grpc.health (service "")."""
        try:
            resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING
