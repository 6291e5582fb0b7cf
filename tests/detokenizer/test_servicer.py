"""DetokenizerService through a real grpc.aio server in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import grpc
import pytest

from ringserve.errors import ErrorInterceptor
from ringserve.message import SamplingParams
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc
from ringserve.v1 import detokenizer_pb2 as pb
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.server import build_servicer

TIMEOUT = 10


class PushStream:
    """A scheduler's side of Push: a bounded outgoing queue and the response iterator."""

    def __init__(self, stub: detokenizer_pb2_grpc.DetokenizerServiceStub, scheduler_id: str) -> None:
        self.out: asyncio.Queue[pb.PushRequest | None] = asyncio.Queue(16)
        self.out.put_nowait(pb.PushRequest(scheduler_id=scheduler_id))
        self.call = stub.Push(self._requests())

    async def _requests(self) -> AsyncIterator[pb.PushRequest]:
        while (req := await self.out.get()) is not None:
            yield req

    @classmethod
    async def connect(cls, stub: detokenizer_pb2_grpc.DetokenizerServiceStub, scheduler_id: str) -> PushStream:
        """Open the stream and wait for its handshake (an empty first message): from then on the
        detokenizer knows this scheduler, so a new subscriber's resync request reaches it. Subscribing
        before that races the stream's registration (the subscriber then asks no one to resync)."""
        push = cls(stub, scheduler_id)
        assert await asyncio.wait_for(push.call.read(), TIMEOUT) == pb.PushResponse()
        return push

    async def send(self, *deltas: pb.TokenDelta, resync: bool = False) -> None:
        await self.out.put(pb.PushRequest(batch=pb.StepBatch(deltas=deltas, sent_at=1.0, resync=resync)))

    async def next_resync(self) -> str:
        resp = await asyncio.wait_for(self.call.read(), TIMEOUT)
        assert resp.HasField("resync")
        return resp.resync.owner


def delta(tok: TextTokenizer, rid: str, owner: str, text: str) -> pb.TokenDelta:
    return pb.TokenDelta(rid=rid, offset=0, ids=tok.encode(text, add_special_tokens=False),
                         params=pb.DecodeParams(owner=owner, stream=True,
                                                sampling_params=SamplingParams(skip_special_tokens=True).to_pb()),
                         finish=common_pb2.FinishReason(type="length"))


async def collect(call: grpc.aio.UnaryStreamCall, n_finished: int) -> dict[str, str]:
    texts: dict[str, str] = {}
    done = 0
    while done < n_finished:
        resp = await asyncio.wait_for(call.read(), TIMEOUT)
        assert resp is not grpc.aio.EOF
        for d in cast(pb.SubscribeResponse, resp).deltas:  # read()'s stub type is object
            texts[d.rid] = texts.get(d.rid, "") + d.text
            done += d.HasField("finish")
    return texts


@pytest.fixture
async def stub(tiny_tok: TextTokenizer) -> AsyncIterator[detokenizer_pb2_grpc.DetokenizerServiceStub]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    servicer = build_servicer(DetokenizerConfig(model="unused", metrics_port=-1), tiny_tok)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
    servicer.close()
    await server.stop(1)


async def test_both_streams_open_with_an_empty_handshake(stub) -> None:  # type: ignore[no-untyped-def]
    """Clients count a stream as up only on this first message, never on a READY channel alone."""
    push = PushStream(stub, "sched-0")
    assert await asyncio.wait_for(push.call.read(), TIMEOUT) == pb.PushResponse()
    sub = stub.Subscribe(pb.SubscribeRequest(owner="tok-a"))
    assert await asyncio.wait_for(sub.read(), TIMEOUT) == pb.SubscribeResponse()
    assert await push.next_resync() == "tok-a"
    await push.out.put(None)
    sub.cancel()


async def test_two_owners_get_only_their_requests(stub, tiny_tok: TextTokenizer) -> None:  # type: ignore[no-untyped-def]
    push = await PushStream.connect(stub, "sched-0")
    sub_a = stub.Subscribe(pb.SubscribeRequest(owner="tok-a"))
    assert await push.next_resync() == "tok-a"  # the new subscriber asks the scheduler to resync
    sub_b = stub.Subscribe(pb.SubscribeRequest(owner="tok-b"))
    assert await push.next_resync() == "tok-b"
    texts = {"a1": ("tok-a", "hello 東京"), "b1": ("tok-b", "emoji 🚀"), "a2": ("tok-a", "more text"),
             "b2": ("tok-b", "ünïcödé")}
    await push.send(*(delta(tiny_tok, rid, owner, t) for rid, (owner, t) in list(texts.items())[:2]))
    await push.send(*(delta(tiny_tok, rid, owner, t) for rid, (owner, t) in list(texts.items())[2:]))
    got_a, got_b = await asyncio.gather(collect(sub_a, 2), collect(sub_b, 2))
    assert got_a == {"a1": "hello 東京", "a2": "more text"}
    assert got_b == {"b1": "emoji 🚀", "b2": "ünïcödé"}
    await push.out.put(None)
    sub_a.cancel()
    sub_b.cancel()


async def test_second_subscriber_replaces_first(stub, tiny_tok: TextTokenizer) -> None:  # type: ignore[no-untyped-def]
    push = await PushStream.connect(stub, "sched-0")
    first = stub.Subscribe(pb.SubscribeRequest(owner="tok-a"))
    assert await push.next_resync() == "tok-a"
    second = stub.Subscribe(pb.SubscribeRequest(owner="tok-a"))
    assert await push.next_resync() == "tok-a"
    assert await asyncio.wait_for(first.read(), TIMEOUT) == pb.SubscribeResponse()  # the handshake
    assert await asyncio.wait_for(first.read(), TIMEOUT) is grpc.aio.EOF  # the old stream ended
    await push.send(delta(tiny_tok, "r", "tok-a", "only the new one"))
    assert await collect(second, 1) == {"r": "only the new one"}
    await push.out.put(None)
    second.cancel()


async def test_backlog_for_owner_without_subscriber(stub, tiny_tok: TextTokenizer) -> None:  # type: ignore[no-untyped-def]
    push = await PushStream.connect(stub, "sched-0")
    await push.send(delta(tiny_tok, "early", "tok-late", "before subscribing"))
    other = stub.Subscribe(pb.SubscribeRequest(owner="tok-x"))
    assert await push.next_resync() == "tok-x"  # the batch before it was processed
    late = stub.Subscribe(pb.SubscribeRequest(owner="tok-late"))
    assert await collect(late, 1) == {"early": "before subscribing"}
    await push.out.put(None)
    late.cancel()
    other.cancel()


async def test_subscribe_without_owner_is_invalid(stub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Subscribe(pb.SubscribeRequest(owner="")):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_batches_queued_behind_a_slow_subscriber_go_out_as_one_message(
        stub, tiny_tok: TextTokenizer) -> None:  # type: ignore[no-untyped-def]
    push = await PushStream.connect(stub, "sched-0")
    for i, text in enumerate(("one", "two", "three")):  # three steps before anyone reads them
        await push.send(delta(tiny_tok, f"r{i}", "tok-m", text))
    other = stub.Subscribe(pb.SubscribeRequest(owner="tok-x"))
    assert await push.next_resync() == "tok-x"  # the three batches before it were processed
    sub = stub.Subscribe(pb.SubscribeRequest(owner="tok-m"))
    assert await asyncio.wait_for(sub.read(), TIMEOUT) == pb.SubscribeResponse()  # the handshake
    merged = cast(pb.SubscribeResponse, await asyncio.wait_for(sub.read(), TIMEOUT))
    assert [(d.rid, d.text) for d in merged.deltas] == [("r0", "one"), ("r1", "two"), ("r2", "three")]
    await push.out.put(None)
    sub.cancel()
    other.cancel()
