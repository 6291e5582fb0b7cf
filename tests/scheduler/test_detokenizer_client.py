"""The scheduler's push stream to the detokenizer comes back whatever ended it (a fake stub isolates it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import detokenizer_pb2
from services.scheduler.rpc import pusher as detokenizer_client
from services.scheduler.rpc.pusher import DetokenizerPusher


class FakeCall:
    """A Push call: the handshake, then nothing to read; writes recorded. `ended`: the detokenizer died
    just before the first batch, so writing it raises what grpc.aio raises on a finished call."""

    def __init__(self, ended: bool) -> None:
        self.ended = ended
        self.writes: list[detokenizer_pb2.PushRequest] = []
        self._reads: asyncio.Queue = asyncio.Queue()
        self._reads.put_nowait(detokenizer_pb2.PushResponse())

    async def write(self, msg: detokenizer_pb2.PushRequest) -> None:
        if self.ended and msg.HasField("batch"):
            raise asyncio.InvalidStateError("RPC already finished.")
        self.writes.append(msg)

    async def read(self) -> detokenizer_pb2.PushResponse:
        return await self._reads.get()

    def cancel(self) -> bool:
        return True


async def test_a_write_to_a_call_that_just_ended_reconnects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[FakeCall] = []

    class Stub:
        def __init__(self, channel) -> None:
            pass

        def Push(self, wait_for_ready: bool = False) -> FakeCall:  # the gRPC method's name
            calls.append(FakeCall(ended=not calls))
            return calls[-1]

    monkeypatch.setattr(detokenizer_client.detokenizer_pb2_grpc, "DetokenizerServiceStub", Stub)
    states: list[bool] = []

    async def on_state(up: bool) -> None:
        states.append(up)

    def on_connect() -> None:  # as the engine thread answers it: the resync batch
        pusher.push(detokenizer_pb2.StepBatch(resync=True), resync=True)

    async def second_call_got_the_batch() -> None:
        while not (len(calls) == 2 and any(m.HasField("batch") for m in calls[1].writes)):
            assert not task.done(), task.exception()  # before the fix: InvalidStateError ended run()
            await asyncio.sleep(0.01)

    pusher = DetokenizerPusher("127.0.0.1:9", "sched-test", on_connect, lambda owner: None, on_state)
    task = asyncio.create_task(pusher.run())
    try:
        await asyncio.wait_for(second_call_got_the_batch(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert states[:3] == [True, False, True] and pusher.batches_sent == 1


async def test_a_batch_queued_as_its_stream_ended_is_not_sent_on_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread hands a batch over while the stream is up, and its put reaches the loop only after
    that stream ended and its queue was cleared: the next stream must begin with the resync, not with it."""
    calls: list[FakeCall] = []

    class Stub:
        def __init__(self, channel) -> None:
            pass

        def Push(self, wait_for_ready: bool = False) -> FakeCall:
            calls.append(FakeCall(ended=False))
            return calls[-1]

    monkeypatch.setattr(detokenizer_client.detokenizer_pb2_grpc, "DetokenizerServiceStub", Stub)
    states: list[bool] = []

    async def on_state(up: bool) -> None:
        states.append(up)

    def on_connect() -> None:
        pusher.push(detokenizer_pb2.StepBatch(resync=True), resync=True)

    async def until(cond) -> None:
        while not cond():
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)

    def batches(call: FakeCall) -> list[detokenizer_pb2.StepBatch]:
        return [m.batch for m in call.writes if m.HasField("batch")]

    pusher = DetokenizerPusher("127.0.0.1:9", "sched-test", on_connect, lambda owner: None, on_state)
    task = asyncio.create_task(pusher.run())
    try:
        await asyncio.wait_for(until(lambda: len(calls) == 1 and len(batches(calls[0])) == 1), 10)
        loop = asyncio.get_running_loop()
        held: list = []
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda cb, *args: held.append((cb, args)))
        stale = detokenizer_pb2.StepBatch(deltas=[detokenizer_pb2.TokenDelta(rid="stale", ids=[5])])
        assert pusher.push(stale)  # handed over while the stream is live; its put is held back
        monkeypatch.undo()
        calls[0]._reads.put_nowait(grpc.aio.EOF)  # the detokenizer ends the stream
        await asyncio.wait_for(until(lambda: False in states), 10)
        for cb, args in held:  # the put lands now, after the ended stream's queue was cleared
            loop.call_soon(cb, *args)
        await asyncio.wait_for(until(lambda: len(calls) == 2 and batches(calls[1])), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    sent = batches(calls[1])
    assert sent[0].resync and not [b for b in sent if any(d.rid == "stale" for d in b.deltas)]
