"""One Connect stream per scheduler: requests and aborts out (batched), load reports and rejections in.

Each SchedulerConnection keeps its stream up by itself: hello first, then whatever requests and
aborts piled up since the last write go out as one ConnectRequest. The stream counts as connected
once the scheduler has answered the hello (it sends a LoadReport right away). When the stream breaks,
the scheduler has already dropped this replica's requests, so the manager is told at once
(`on_down`) and the connection retries with backoff. The request queue is bounded: a slow
scheduler pushes back on intake instead of growing memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from ringserve.errors import Unavailable, status_of
from ringserve.grpc_server import client_channel
from ringserve.message import Load, LoraAdapter, TokenizedReq
from ringserve.reconnect import reconnect_forever
from ringserve.v1 import scheduler_pb2, scheduler_pb2_grpc

from .discovery import parse_dns_target
from .routing import SchedulerView

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
MAX_QUEUED_REQUESTS = 4096
MAX_BATCH = 256


class SchedulerConnection:
    def __init__(self, address: str, owner: str, on_rejection: Callable[[str, grpc.StatusCode, str], None],
                 on_down: Callable[[str], None], on_change: Callable[[], None]) -> None:
        self.address = address
        self.owner = owner
        self.on_rejection = on_rejection
        self.on_down = on_down
        self.on_change = on_change
        self.connected = False
        self.load = Load()
        self.weight_version = "default"  # from GetSchedulerInfo on connect, then each weight update
        self.paused = ""  # the pause mode while paused (GetSchedulerInfo on connect, then PauseGeneration)
        self.attention_backend = ""  # GetSchedulerInfo on connect: reported in server info
        self.cuda_graph = False
        self.overlap_schedule = False
        self.dtype = ""
        self.kv_cache_dtype = ""
        # Told the scheduler's LoRA adapters on every connect (the tokenizer's registry syncs: lora.py).
        self.on_lora_info: Callable[[SchedulerConnection, list[LoraAdapter]], None] | None = None
        self.architecture = ""  # the model class served and all the scheduler can serve (GetSchedulerInfo)
        self.supported_architectures: list[str] = []
        self.channel = client_channel(address)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        # Items carry the session they were queued in: a request queued just before a break was
        # already failed by on_down and must not be sent on the next stream.
        self._queue: asyncio.Queue[tuple[int, TokenizedReq]] = asyncio.Queue(MAX_QUEUED_REQUESTS)
        self._aborts: list[str] = []  # bounded by the live requests (each is aborted at most once)
        self._wake = asyncio.Event()
        self._session = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"scheduler {self.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()

    async def send(self, reqs: list[TokenizedReq]) -> None:
        if not self.connected:
            raise Unavailable(f"scheduler {self.address} unavailable")
        session = self._session
        for r in reqs:
            await self._queue.put((session, r))
        self._wake.set()

    def abort(self, rids: list[str]) -> None:
        # A broken stream already aborted everything there; nothing to send.
        if self.connected:
            self._aborts.extend(rids)
            self._wake.set()

    async def _run(self) -> None:
        await reconnect_forever(f"scheduler {self.address} stream", self._stream, self._mark_down,
                                BACKOFF_MIN_S, BACKOFF_MAX_S)

    def _mark_down(self) -> None:
        self._session += 1
        self._aborts.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        if self.connected:
            self.connected = False
            log.warning("scheduler %s disconnected", self.address)
            self.on_down(self.address)
            self.on_change()

    async def _stream(self) -> None:
        call = self.stub.Connect()
        try:
            await call.write(scheduler_pb2.ConnectRequest(hello=scheduler_pb2.Hello(owner=self.owner)))
            first = await call.read()
            if first is grpc.aio.EOF:
                return
            self._on_response(first)
            await self._read_info()
            self.connected = True
            log.info("scheduler %s connected (owner %s)", self.address, self.owner)
            self.on_change()
            writer = asyncio.create_task(self._write_loop(call, self._session))
            try:
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        return
                    self._on_response(resp)
            finally:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
        finally:
            call.cancel()

    def _on_response(self, resp: scheduler_pb2.ConnectResponse) -> None:
        if resp.HasField("load"):
            self.load = Load.from_pb(resp.load)
        for rej in resp.rejections:
            self.on_rejection(rej.rid, status_of(rej.status_code),
                              rej.message or f"rejected by scheduler {self.address}")

    async def _write_loop(self, call: grpc.aio.StreamStreamCall, session: int) -> None:
        while True:
            if self._queue.empty() and not self._aborts:
                self._wake.clear()
                await self._wake.wait()
            now = time.time()
            reqs: list[scheduler_pb2.TokenizedRequest] = []
            while not self._queue.empty() and len(reqs) < MAX_BATCH:
                item_session, req = self._queue.get_nowait()
                if item_session == session:
                    reqs.append(req.to_pb(now))
            aborts, self._aborts = self._aborts, []
            if reqs and aborts:
                # Cancelled before it was even sent: send neither, whatever order the scheduler
                # applies requests and aborts of one message in.
                dropped = set(aborts) & {r.rid for r in reqs}
                reqs = [r for r in reqs if r.rid not in dropped]
                aborts = [a for a in aborts if a not in dropped]
            if reqs or aborts:
                await call.write(scheduler_pb2.ConnectRequest(requests=reqs, abort_rids=aborts))

    async def _read_info(self) -> None:
        try:
            info = await self.stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            log.warning("scheduler %s: GetSchedulerInfo failed (%s); weight_version unknown", self.address,
                        e.code().name)
            return
        self.weight_version, self.paused = info.weight_version or "default", info.paused
        self.attention_backend, self.cuda_graph = info.attention_backend, info.cuda_graph
        self.overlap_schedule, self.dtype, self.kv_cache_dtype = info.overlap_schedule, info.dtype, info.kv_cache_dtype
        if self.on_lora_info is not None:
            self.on_lora_info(self, [LoraAdapter.from_pb(a) for a in info.lora_adapters])
        self.architecture, self.supported_architectures = info.architecture, list(info.supported_architectures)

    async def flush_cache(self) -> tuple[bool, str]:
        try:
            resp = await self.stub.FlushCache(scheduler_pb2.SchedulerServiceFlushCacheRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            return False, f"scheduler {self.address}: {e.code().name}: {e.details()}"
        return resp.success, resp.message


class SchedulerPool:
    """Every scheduler this tokenizer routes to (implements tokenizer_manager.SchedulerLinks)."""

    def __init__(self, addresses: list[str], owner: str, on_rejection: Callable[[str, grpc.StatusCode, str], None],
                 on_down: Callable[[str], None], on_change: Callable[[], None]) -> None:
        self._new = lambda a: self._connection(SchedulerConnection(a, owner, on_rejection, on_down, on_change))
        self.on_lora_info: Callable[[SchedulerConnection, list[LoraAdapter]], None] | None = None
        self.on_change = on_change
        # dns:/// targets get their connections from discovery (set_addresses), not here.
        self.conns = {a: self._new(a) for a in addresses if parse_dns_target(a) is None}
        self._by_target: dict[str, set[str]] = {}
        self._started = False

    def _connection(self, conn: SchedulerConnection) -> SchedulerConnection:
        conn.on_lora_info = lambda c, adapters: self.on_lora_info(c, adapters) if self.on_lora_info else None
        return conn

    def start(self) -> None:
        self._started = True
        for c in self.conns.values():
            c.start()

    async def set_addresses(self, target: str, addresses: list[str]) -> None:
        """Make the connections of a discovered target exactly `addresses` (pods came or went)."""
        old = self._by_target.get(target, set())
        new = set(addresses)
        for a in sorted(new - old):
            if a not in self.conns:
                log.info("scheduler %s discovered via %s", a, target)
                self.conns[a] = self._new(a)
                if self._started:
                    self.conns[a].start()
        for a in sorted(old - new):
            conn = self.conns.pop(a, None)
            if conn is not None:
                log.info("scheduler %s gone from %s", a, target)
                await conn.close()  # its in-flight requests end UNAVAILABLE via on_down
        self._by_target[target] = new
        self.on_change()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.conns.values()))

    def any_connected(self) -> bool:
        return any(c.connected for c in self.conns.values())

    def weight_version(self, address: str) -> str:
        conn = self.conns.get(address)
        return conn.weight_version if conn is not None else "default"

    def architectures(self) -> tuple[str, list[str]]:
        """(architecture served, architectures supported) as the first scheduler that answered says."""
        for conn in self.conns.values():
            if conn.architecture:
                return conn.architecture, conn.supported_architectures
        return "", []

    def views(self, in_flight: dict[str, int]) -> list[SchedulerView]:
        return [SchedulerView(a, c.connected, c.load, in_flight.get(a, 0), c.attention_backend, c.cuda_graph,
                              c.overlap_schedule, c.dtype, c.kv_cache_dtype)
                for a, c in self.conns.items()]

    async def send(self, address: str, reqs: list[TokenizedReq]) -> None:
        conn = self.conns.get(address)
        if conn is None:  # removed by discovery between routing and sending
            raise Unavailable(f"scheduler {address} unavailable")
        await conn.send(reqs)

    def abort(self, address: str, rids: list[str]) -> None:
        conn = self.conns.get(address)
        if conn is not None:
            conn.abort(rids)

    async def flush_cache(self) -> tuple[bool, str]:
        down = [a for a, c in self.conns.items() if not c.connected]
        if down:
            return False, "scheduler(s) unavailable: " + ", ".join(down)
        results = await asyncio.gather(*(c.flush_cache() for c in self.conns.values()))
        failed = [msg or "refused" for ok, msg in results if not ok]
        return (not failed), "; ".join(failed)
