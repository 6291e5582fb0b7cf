"""Where a request's output goes, chosen per request: the detokenizer push stream (the ring), or
straight back on the gRPC call that submitted it (the SGLang protocol's `Generate`, whose client
detokenizes itself).

`OutputRouter.route` runs on the engine thread for every step batch: deltas of requests registered
with a `DirectStream` go to it, the rest go on to the detokenizer. Direct requests carry a rid prefix
that is random per process, so a delta that arrives after its stream went away (its abort was still
in the inbox when the step ran) is recognised and dropped, never pushed to a detokenizer that does
not know it.

A `DirectStream` is a mailbox, not a queue: the engine thread merges each new delta into the one
waiting for its index, so a slow reader never holds more than its own requests' output (bounded by
max_new_tokens) and never blocks the engine thread, which serves every other request too.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import replace

from ringserve.message import StepBatch, TokenDelta


def merge(old: TokenDelta, new: TokenDelta) -> TokenDelta:
    """One delta with the output of `old` followed by `new` (same request, `new` right after `old`)."""
    return replace(old, ids=old.ids + new.ids, logprobs=old.logprobs + new.logprobs,
                   finish=new.finish, cached_tokens=new.cached_tokens, timings=new.timings or old.timings,
                   input_logprobs=old.input_logprobs or new.input_logprobs,
                   params=old.params or new.params, weight_version=new.weight_version or old.weight_version)


class DirectStream:
    """The outputs of one Generate call (n requests, one per index), handed from the engine thread to
    the call's coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[int, TokenDelta] = {}
        self._ready = asyncio.Event()
        self.cancelled: str | None = None  # why the call was ended from outside (Abort), else None

    def put(self, index: int, delta: TokenDelta) -> None:
        """Engine thread: add the delta of the request at `index`."""
        with self._lock:
            wake = not self._pending
            old = self._pending.get(index)
            self._pending[index] = delta if old is None else merge(old, delta)
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    def cancel(self, reason: str) -> None:
        """Event loop: end the call now (the Abort RPC); `take` returns at once."""
        self.cancelled = reason
        self._ready.set()

    async def take(self) -> dict[int, TokenDelta]:
        """Event loop: wait for output, then take all of it (index -> delta since the last take)."""
        await self._ready.wait()
        with self._lock:
            out, self._pending = self._pending, {}
            self._ready.clear()  # under the lock: a put after this finds _pending empty and sets it again
        return out


class OutputRouter:
    def __init__(self) -> None:
        self.prefix = f"sg{secrets.token_hex(4)}/"  # marks direct requests' rids (see the module doc)
        self._streams: dict[str, tuple[DirectStream, int]] = {}  # rid -> (stream, index)
        self._lock = threading.Lock()

    def rid(self, request_id: str, index: int, n: int) -> str:
        """The scheduler's rid of sample `index` of a direct request."""
        return f"{self.prefix}{request_id}" if n == 1 else f"{self.prefix}{request_id}#{index}"

    def register(self, rids: list[str], stream: DirectStream) -> None:
        with self._lock:
            for i, rid in enumerate(rids):
                self._streams[rid] = (stream, i)

    def unregister(self, rids: list[str]) -> None:
        with self._lock:
            for rid in rids:
                self._streams.pop(rid, None)

    def __len__(self) -> int:
        return len(self._streams)

    def route(self, batch: StepBatch) -> StepBatch:
        """Engine thread: deliver direct requests' deltas; the batch of the rest (for the detokenizer).
        A resync batch re-sends full state for a fresh detokenizer: direct requests have no part in it."""
        rest: list[TokenDelta] = []
        with self._lock:
            for d in batch.deltas:
                if not d.rid.startswith(self.prefix):
                    rest.append(d)
                elif not batch.resync and (target := self._streams.get(d.rid)) is not None:
                    target[0].put(target[1], d)
        return batch if len(rest) == len(batch.deltas) else replace(batch, deltas=rest)
