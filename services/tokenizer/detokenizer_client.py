"""Subscribe(owner) to every detokenizer and feed its TextDeltas to the manager.

A subscription counts as up once the detokenizer's empty first message arrives
(`ringserve.reconnect.handshake`: the subscription is registered there); without it the call is
dropped and retried, so a call stuck in a broken channel never passes for a live subscription. Each
(re)subscribe makes the schedulers re-send this owner's requests from offset 0; ReqState drops what
it already has. While no subscription is up, requests stay alive for `grace_s`; after that they
fail with UNAVAILABLE (`on_grace_expired`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from ringserve.finish import finish_from_pb
from ringserve.grpc_server import client_channel
from ringserve.reconnect import handshake, reconnect_forever
from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc

from .io_struct import Logprob, TextDeltaIn

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
TIMING_FIELDS = [f.name for f in common_pb2.Timings.DESCRIPTOR.fields]


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> Logprob:
    return Logprob(token_id=pb.token_id, logprob=pb.logprob,
                   top=tuple((t.token_id, t.logprob) for t in pb.top_logprobs))


def delta_from_pb(pb: detokenizer_pb2.TextDelta) -> TextDeltaIn:
    timings = None
    if pb.HasField("timings"):
        timings = {name: getattr(pb.timings, name) for name in TIMING_FIELDS if getattr(pb.timings, name)}
    return TextDeltaIn(rid=pb.rid, token_offset=pb.token_offset, ids=list(pb.ids), text_offset=pb.text_offset,
                       text=pb.text, logprobs=[logprob_from_pb(lp) for lp in pb.logprobs],
                       finish=finish_from_pb(pb.finish) if pb.HasField("finish") else None,
                       prompt_tokens=pb.prompt_tokens, cached_tokens=pb.cached_tokens, timings=timings,
                       input_logprobs=[logprob_from_pb(lp) for lp in pb.input_logprobs])


class DetokenizerSubscriber:
    def __init__(self, addresses: list[str], owner: str, on_deltas: Callable[[list[TextDeltaIn], float], None],
                 on_change: Callable[[], None], on_grace_expired: Callable[[], None], grace_s: float) -> None:
        self.owner = owner
        self.on_deltas = on_deltas
        self.on_change = on_change
        self.on_grace_expired = on_grace_expired
        self.grace_s = grace_s
        self.channels = {a: client_channel(a) for a in addresses}
        self.up: dict[str, bool] = {a: False for a in addresses}
        self._tasks: list[asyncio.Task[None]] = []
        self._grace: asyncio.TimerHandle | None = None

    def all_connected(self) -> bool:
        return all(self.up.values())

    def any_connected(self) -> bool:
        return any(self.up.values())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(a), name=f"detokenizer {a}") for a in self.channels]
        self._arm_grace()

    async def close(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.channels.values()))

    def _set_up(self, address: str, up: bool) -> None:
        if self.up[address] == up:
            return
        self.up[address] = up
        log.info("detokenizer %s %s (owner %s)", address, "subscribed" if up else "disconnected", self.owner)
        self._arm_grace()
        self.on_change()

    def _arm_grace(self) -> None:
        """A timer, not a poll: it runs only if no subscription comes back within the grace period."""
        if self.any_connected():
            if self._grace is not None:
                self._grace.cancel()
                self._grace = None
        elif self._grace is None:
            self._grace = asyncio.get_running_loop().call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self._grace = None
        log.warning("no detokenizer for %.0fs: failing in-flight requests", self.grace_s)
        self.on_grace_expired()
        self._arm_grace()

    async def _run(self, address: str) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(self.channels[address])
        await reconnect_forever(f"detokenizer {address} subscription", lambda: self._subscribe(address, stub),
                                lambda: self._set_up(address, False), BACKOFF_MIN_S, BACKOFF_MAX_S)

    async def _subscribe(self, address: str, stub: detokenizer_pb2_grpc.DetokenizerServiceStub) -> None:
        call = stub.Subscribe(detokenizer_pb2.SubscribeRequest(owner=self.owner))
        try:
            if not await handshake(call):
                log.warning("detokenizer %s: no subscription handshake; retrying", address)
                return
            self._set_up(address, True)
            while (resp := await call.read()) is not grpc.aio.EOF:
                if resp.deltas:
                    # The step's scheduler -> detokenizer -> here hops (wall clocks, as sent_at is).
                    hops = max(0.0, time.time() - resp.step_sent_at) if resp.step_sent_at else 0.0
                    self.on_deltas([delta_from_pb(d) for d in resp.deltas], hops)
        finally:
            call.cancel()
