"""The scheduler thread's inbox: what other threads hand it, in arrival order, and bounded.

The gRPC event loop (and in-process callers) put messages here; the engine thread takes them all at
the start of a step (`take`), so an abort applies to exactly what arrived before it. A request that
cannot be served is refused here, at submit, and only here (one channel): `submit` raises an error
with its status, which the servicer turns into a Rejection.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ringserve.errors import InvalidArgument, ResourceExhausted
from services.scheduler.core.req import Req


class QueueFull(ResourceExhausted):
    """The waiting queue is at --max-queued-requests."""


@dataclass(frozen=True, slots=True)
class AbortRid:
    rid: str


@dataclass(frozen=True, slots=True)
class AbortOwner:
    """Every request of a tokenizer replica (its Connect stream ended)."""

    owner: str


@dataclass(frozen=True, slots=True)
class Resync:
    """Re-send the full state of one owner's requests (None: everyone's, after a reconnect)."""

    owner: str | None


Message = Req | AbortRid | AbortOwner | Resync


class Inbox:
    def __init__(self, max_queued_requests: int, max_prompt_tokens: int) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_prompt_tokens = max_prompt_tokens
        self._cond = threading.Condition()
        self._messages: deque[Message] = deque()  # bounded: requests by the check below, the rest by live requests
        self._new = 0            # requests in _messages
        self.queued = 0          # requests submitted and not yet running (set by the engine after each step)

    # -- any thread --------------------------------------------------------------------------------

    def submit(self, req: Req) -> None:
        """Queue a request, or refuse it: InvalidArgument for a prompt that cannot be served,
        QueueFull at --max-queued-requests."""
        n = len(req.origin_input_ids)
        if not 0 < n <= self.max_prompt_tokens:
            raise InvalidArgument("input_ids", f"{n} tokens; must be 1 to {self.max_prompt_tokens}")
        with self._cond:
            if self.queued + self._new >= self.max_queued_requests:
                raise QueueFull(f"{self.queued + self._new} requests queued (max {self.max_queued_requests})")
            self._new += 1
            self._messages.append(req)
            self._cond.notify_all()  # the engine thread, and any wait_idle / weight-update drain waiting too

    def put(self, msg: AbortRid | AbortOwner | Resync) -> None:
        with self._cond:
            self._messages.append(msg)
            self._cond.notify_all()

    @property
    def pending_requests(self) -> int:
        """Requests submitted since the last step took them (not yet in the scheduler's counts)."""
        return self._new

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the engine thread -------------------------------------------------------------------------

    def take(self) -> list[Message]:
        with self._cond:
            msgs, self._messages = list(self._messages), deque()
            self._new = 0
            return msgs

    def wait(self, timeout: float, busy: bool) -> bool:
        """Block until a message arrives or timeout, unless `busy`; True when there is work."""
        with self._cond:
            if not (self._messages or busy):
                self._cond.wait(timeout)
            return bool(self._messages) or busy

    def __bool__(self) -> bool:
        return bool(self._messages)
