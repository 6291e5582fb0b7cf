"""GenerateSession alone: batching, statuses, cancel, drain and the outbox bound (no gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from ringserve.errors import InvalidArgument
from ringserve.v1 import api_pb2 as pb
from services.tokenizer.generate_session import GenerateSession


class Handler:
    """Fake generations: "<rid>" yields `steps` messages, one per `tick`; "bad" fails; "boom" has a bug."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.tick = asyncio.Event()
        self.closed: list[str] = []

    async def __call__(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if req.text == "bad":
                raise InvalidArgument("sampling_params.temperature", "must be >= 0")
            for k in range(self.steps):
                await self.tick.wait()
                await asyncio.sleep(0)  # a step of the engine: other generations and the writer run
                if req.text == "boom":
                    raise RuntimeError("bug")
                yield pb.GenerateResponse(rid=req.rid, text=f"{k}", output_ids=[k], finished=k == self.steps - 1)
        finally:
            self.closed.append(req.rid)


def gen(rid: str, text: str = "x") -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(generate=pb.GenerateRequest(rid=rid, text=text))


async def instructions(*msgs: pb.GenerateStreamRequest, hold: asyncio.Event | None = None
                       ) -> AsyncIterator[pb.GenerateStreamRequest]:
    for m in msgs:
        yield m
    if hold is not None:
        await hold.wait()  # keep the client's side open


async def drain(session: GenerateSession, handler: Handler) -> list[pb.GenerateStreamResponse]:
    out = []
    async for batch in session.batches():
        out.append(batch)
        handler.tick.set()  # let every generation make its next step after each write
    return out


async def test_outputs_of_many_generations_share_messages_and_end_with_a_status() -> None:
    handler = Handler()
    session = GenerateSession(handler)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), gen("b"), gen("c"))))
    handler.tick.set()
    batches = await drain(session, handler)
    await feed
    per_rid: dict[str, str] = {}
    for b in batches:
        for o in b.outputs:
            per_rid[o.rid] = per_rid.get(o.rid, "") + o.text
    assert per_rid == {"a": "012", "b": "012", "c": "012"}
    assert max(len({o.rid for o in b.outputs}) for b in batches) == 3  # one message carried all three
    statuses = [s for b in batches for s in b.statuses]
    assert sorted(s.rid for s in statuses) == ["a", "b", "c"] and all(s.code == 0 for s in statuses)
    for b in batches:  # a status never precedes an output of its rid
        for s in b.statuses:
            later = [x for b2 in batches[batches.index(b) + 1:] for x in b2.outputs if x.rid == s.rid]
            assert not later


async def test_errors_are_per_generation_statuses() -> None:
    handler = Handler()
    session = GenerateSession(handler)
    feed = asyncio.ensure_future(session.feed(instructions(
        gen("ok"), gen("bad", "bad"), gen("boom", "boom"), gen(""), gen("ok"),
        pb.GenerateStreamRequest())))
    handler.tick.set()
    batches = await drain(session, handler)
    await feed
    statuses = {(s.rid, s.code): s.message for b in batches for s in b.statuses}
    assert statuses[("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])].startswith("sampling_params.temperature:")
    assert "RuntimeError" in statuses[("boom", grpc.StatusCode.INTERNAL.value[0])]
    assert statuses[("", grpc.StatusCode.INVALID_ARGUMENT.value[0])].startswith(("generate.rid", "action"))
    assert ("ok", grpc.StatusCode.ALREADY_EXISTS.value[0]) in statuses  # the second "ok" while the first runs
    assert ("ok", 0) in statuses
    assert "".join(o.text for b in batches for o in b.outputs if o.rid == "ok") == "012"


async def test_cancel_closes_the_generation_and_sends_nothing_more() -> None:
    handler = Handler(steps=1000)
    hold = asyncio.Event()
    session = GenerateSession(handler)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), gen("b"), hold=hold)))
    handler.tick.set()
    seen: list[pb.GenerateStreamResponse] = []
    async for batch in session.batches():
        seen.append(batch)
        if len(seen) == 2:
            session.cancel("a")
            session.cancel("b")
            hold.set()
    await feed
    await asyncio.sleep(0)
    assert sorted(handler.closed) == ["a", "b"]  # the handlers' cleanup ran (the tokenizer aborts there)
    assert not any(b.statuses for b in seen) and not session.tasks


async def test_draining_refuses_new_generations_and_ends_when_idle() -> None:
    handler = Handler()
    stopping = asyncio.Event()
    hold = asyncio.Event()  # the client never half-closes: drain alone must end the stream
    session = GenerateSession(handler, stopping)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), hold=hold)))
    await asyncio.sleep(0)
    stopping.set()
    session.start(pb.GenerateRequest(rid="late", text="x"))
    handler.tick.set()
    batches = await asyncio.wait_for(drain(session, handler), 5)
    statuses = {s.rid: s.code for b in batches for s in b.statuses}
    assert statuses == {"a": 0, "late": grpc.StatusCode.UNAVAILABLE.value[0]}
    feed.cancel()
    await session.close()


async def test_the_outbox_is_bounded_and_close_stops_everything() -> None:
    handler = Handler(steps=100)
    handler.tick.set()
    session = GenerateSession(handler, limit=4)
    for rid in "abc":
        session.start(pb.GenerateRequest(rid=rid, text="x"))
    for _ in range(50):
        await asyncio.sleep(0)
        assert len(session.outputs) + len(session.statuses) <= 4  # nobody reads: producers wait
    await session.close()
    assert sorted(handler.closed) == ["a", "b", "c"] and not session.tasks

