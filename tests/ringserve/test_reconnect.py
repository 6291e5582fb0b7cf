"""The stream handshake (the real streams: tests/detokenizer/test_servicer.py and tests/e2e)."""

from __future__ import annotations

import asyncio

import grpc

from ringserve.reconnect import handshake


class FakeCall:
    def __init__(self, first: object, delay_s: float = 0.0) -> None:
        self.first, self.delay_s = first, delay_s

    async def read(self) -> object:
        await asyncio.sleep(self.delay_s)  # a server that answers late (or never, within the test)
        return self.first


def test_first_message_means_up() -> None:
    assert asyncio.run(handshake(FakeCall(object())))


def test_end_of_stream_or_silence_means_not_up() -> None:
    assert not asyncio.run(handshake(FakeCall(grpc.aio.EOF)))
    assert not asyncio.run(handshake(FakeCall(object(), delay_s=1.0), timeout_s=0.05))
