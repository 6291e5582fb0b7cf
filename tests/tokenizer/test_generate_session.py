"""GenerateSession alone: batching, statuses, cancel, drain and the outbox bound (no gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from ringserve.errors import InvalidArgument, ServiceError
from ringserve.v1 import api_pb2 as pb
from services.tokenizer.generate_session import GenerateSession
from services.tokenizer.request_state import Wakeup


class FakeCall:
    def __init__(self, rid: str, text: str, wakeup: Wakeup) -> None:
        self.rid, self.text, self.wakeup = rid, text, wakeup
        self.made = self.sent = 0


class Fake:
    """Fake generations: "<rid>" makes `steps` tokens, one per engine step (`tick`); "bad" fails at
    intake; "boom" has a bug when collected. A collect merges what is new into one message, as the
    manager's request states do."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.live: list[FakeCall] = []
        self.released: list[str] = []

    async def start(self, req: pb.GenerateRequest, wakeup: Wakeup) -> FakeCall:
        if req.text == "bad":
            raise InvalidArgument("sampling_params.temperature", "must be >= 0")
        await asyncio.sleep(0)  # the intake awaits the scheduler link
        call = FakeCall(req.rid, req.text, wakeup)
        self.live.append(call)
        return call

    def tick(self) -> None:
        for call in self.live:
            if call.made < self.steps:
                call.made += 1
                call.wakeup.set()

    def collect(self, call: FakeCall, into: RepeatedCompositeFieldContainer[pb.GenerateResponse]
                ) -> tuple[bool, ServiceError | None]:
        if call.text == "boom":
            raise RuntimeError("bug")
        new = range(call.sent, call.made)
        call.sent = call.made
        done = call.sent == self.steps
        if new:
            into.add(rid=call.rid, text="".join(map(str, new)), output_ids=list(new), finished=done)
        return done, None

    def release(self, call: FakeCall) -> None:
        self.released.append(call.rid)
        self.live.remove(call)


async def engine(fake: Fake) -> None:
    """One engine step per turn of the loop, as the scheduler's deltas would arrive."""
    while True:
        fake.tick()
        await asyncio.sleep(0)


def gen(rid: str, text: str = "x") -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(generate=pb.GenerateRequest(rid=rid, text=text))


async def instructions(*msgs: pb.GenerateStreamRequest, hold: asyncio.Event | None = None
                       ) -> AsyncIterator[pb.GenerateStreamRequest]:
    for m in msgs:
        yield m
    if hold is not None:
        await hold.wait()  # keep the client's side open


async def drain(session: GenerateSession, fake: Fake) -> list[pb.GenerateStreamResponse]:
    steps = asyncio.ensure_future(engine(fake))
    try:
        return [batch async for batch in session.batches()]
    finally:
        steps.cancel()


async def test_outputs_of_many_generations_share_messages_and_end_with_a_status() -> None:
    fake = Fake()
    session = GenerateSession(fake)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), gen("b"), gen("c"))))
    batches = await drain(session, fake)
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
    fake = Fake()
    session = GenerateSession(fake)
    feed = asyncio.ensure_future(session.feed(instructions(
        gen("ok"), gen("bad", "bad"), gen("boom", "boom"), gen(""), gen("ok"),
        pb.GenerateStreamRequest())))
    batches = await drain(session, fake)
    await feed
    statuses = {(s.rid, s.code): s.message for b in batches for s in b.statuses}
    assert statuses[("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])].startswith("sampling_params.temperature:")
    assert "RuntimeError" in statuses[("boom", grpc.StatusCode.INTERNAL.value[0])]
    assert statuses[("", grpc.StatusCode.INVALID_ARGUMENT.value[0])].startswith(("generate.rid", "action"))
    assert ("ok", grpc.StatusCode.ALREADY_EXISTS.value[0]) in statuses  # the second "ok" while the first runs
    assert ("ok", 0) in statuses
    assert "".join(o.text for b in batches for o in b.outputs if o.rid == "ok") == "012"
    assert sorted(fake.released) == ["boom", "ok"] and not fake.live  # "bad" never started


async def test_cancel_closes_the_generation_and_sends_nothing_more() -> None:
    fake = Fake(steps=1000)
    hold = asyncio.Event()
    session = GenerateSession(fake)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), gen("b"), hold=hold)))
    steps = asyncio.ensure_future(engine(fake))
    seen: list[pb.GenerateStreamResponse] = []
    async for batch in session.batches():
        seen.append(batch)
        if len(seen) == 2:
            session.cancel("a")
            session.cancel("b")
            hold.set()
    steps.cancel()
    await feed
    assert sorted(fake.released) == ["a", "b"]  # released: the tokenizer aborts them at the scheduler
    assert not any(b.statuses for b in seen) and not session.running and not session.starting


async def test_cancel_during_intake_releases_the_generation_once_started() -> None:
    fake = Fake()
    session = GenerateSession(fake)
    session.start(pb.GenerateRequest(rid="a", text="x"))
    session.cancel("a")  # before its intake ran at all: nothing to release
    session.start(pb.GenerateRequest(rid="b", text="x"))
    await asyncio.sleep(0)  # b's intake is now waiting on the scheduler link
    session.cancel("b")
    for _ in range(3):
        await asyncio.sleep(0)
    assert fake.released == [] and not fake.live and not session.starting


async def test_draining_refuses_new_generations_and_ends_when_idle() -> None:
    fake = Fake()
    stopping = asyncio.Event()
    hold = asyncio.Event()  # the client never half-closes: drain alone must end the stream
    session = GenerateSession(fake, stopping)
    feed = asyncio.ensure_future(session.feed(instructions(gen("a"), hold=hold)))
    await asyncio.sleep(0)
    stopping.set()
    session.start(pb.GenerateRequest(rid="late", text="x"))
    batches = await asyncio.wait_for(drain(session, fake), 5)
    statuses = {s.rid: s.code for b in batches for s in b.statuses}
    assert statuses == {"a": 0, "late": grpc.StatusCode.UNAVAILABLE.value[0]}
    feed.cancel()
    await session.close()


async def test_the_outbox_is_bounded_and_close_stops_everything() -> None:
    fake = Fake(steps=5)
    session = GenerateSession(fake, limit=4)
    for rid in "abcdef":
        session.start(pb.GenerateRequest(rid=rid, text="x"))
    for _ in range(3):
        await asyncio.sleep(0)
    fake.tick()
    fake.tick()  # two steps while nobody reads: they wait in the calls, merged
    batches = session.batches()
    first = await anext(batches)
    assert len(first.outputs) == 4 and {o.text for o in first.outputs} == {"01"}
    second = await anext(batches)  # the two that did not fit come next, nothing lost
    assert len(second.outputs) == 2 and {o.text for o in second.outputs} == {"01"}
    assert {o.rid for o in [*first.outputs, *second.outputs]} == set("abcdef")
    await batches.aclose()
    await session.close()
    assert sorted(fake.released) == list("abcdef") and not session.running

