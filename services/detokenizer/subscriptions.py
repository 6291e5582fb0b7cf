"""Routing of text batches to tokenizer replicas: one bounded queue per subscribed owner.

- A subscriber's queue is bounded; `publish` awaits when it is full, which stops the Push stream
  from being read, which backpressures the scheduler through gRPC flow control.
- A second subscriber for the same owner replaces the first (the old stream ends) and gets what the
  first had not sent yet; a subscription that ends leaves what it had not sent in the backlog.
- Batches for an owner with no subscriber go to a bounded backlog that the next subscriber gets
  first; beyond the bound they are dropped with a log line (the resync that every new subscriber
  triggers re-sends them). The number of owners with a backlog is bounded too.

Nothing that can be kept is dropped: the tokenizer drops a delta that starts past what it holds and
waits for the resync, so every batch lost here stalls that owner's streams until the resync arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Closed:
    """Queue marker: the subscription ended (replaced or draining)."""


CLOSED = _Closed()


class Subscription(Generic[T]):
    def __init__(self, owner: str, maxsize: int) -> None:
        self.owner = owner
        self.queue: asyncio.Queue[T | _Closed] = asyncio.Queue(maxsize=maxsize)
        self.closed = False
        self._marker_taken = False  # take_ready met the close marker: get() answers None next

    async def get(self) -> T | None:
        """Next batch, or None once the subscription is closed."""
        if self._marker_taken:
            return None
        item = await self.queue.get()
        return None if isinstance(item, _Closed) else item

    def take_ready(self, limit: int) -> list[T]:
        """Up to `limit` batches queued now, in order, without waiting (none past the close marker)."""
        items: list[T] = []
        while len(items) < limit and not self._marker_taken and not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Closed):
                self._marker_taken = True
            else:
                items.append(item)
        return items

    def take_pending(self) -> list[T]:
        """What is queued and not yet sent, in order (the queue is left empty)."""
        items: list[T] = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not isinstance(item, _Closed):
                items.append(item)
        return items

    def close(self, drop_pending: bool) -> None:
        """End the stream (the caller took what it wanted to keep with take_pending)."""
        if self.closed:
            return
        self.closed = True
        if drop_pending:
            self.take_pending()
        if self.queue.full():  # draining: make room for the marker by dropping the oldest item
            self.queue.get_nowait()
            log.warning("owner=%s one queued batch dropped at close", self.owner)
        self.queue.put_nowait(CLOSED)


class Subscriptions(Generic[T]):
    def __init__(self, queue_size: int = 256, backlog_size: int = 1024, max_backlog_owners: int = 64,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.queue_size = queue_size
        self.backlog_size = backlog_size
        self.max_backlog_owners = max_backlog_owners
        self.subs: dict[str, Subscription[T]] = {}
        self.backlogs: OrderedDict[str, deque[T]] = OrderedDict()
        self._on_change = on_change or (lambda n: None)

    def __len__(self) -> int:
        return len(self.subs)

    def subscribe(self, owner: str) -> Subscription[T]:
        old = self.subs.get(owner)
        carried: list[T] = []
        if old is not None:
            # Its pending batches are the same owner's stream, in order: the new subscriber sends them.
            carried = old.take_pending() if not old.closed else []
            log.info("owner=%s new subscriber replaces the previous one (%d batches carried over)",
                     owner, len(carried))
            old.close(drop_pending=True)
        sub: Subscription[T] = Subscription(owner, self.queue_size)
        items = [*self.backlogs.pop(owner, ()), *carried]
        if len(items) > self.queue_size:
            log.warning("owner=%s %d queued batches dropped at subscribe (queue %d); the resync re-sends",
                        owner, len(items) - self.queue_size, self.queue_size)
            items = items[:self.queue_size]
        for item in items:
            sub.queue.put_nowait(item)
        self.subs[owner] = sub
        self._on_change(len(self.subs))
        return sub

    def unsubscribe(self, sub: Subscription[T]) -> None:
        """Called when a Subscribe stream ends; a no-op if it was already replaced. What it had not
        sent goes to the backlog, for the owner's next subscriber."""
        current = self.subs.get(sub.owner) is sub
        pending = sub.take_pending() if current and not sub.closed else []
        sub.close(drop_pending=True)
        if current:
            del self.subs[sub.owner]
            for item in pending:
                self._to_backlog(sub.owner, item)
            self._on_change(len(self.subs))

    async def publish(self, owner: str, item: T) -> None:
        sub = self.subs.get(owner)
        if sub is not None and not sub.closed:
            await sub.queue.put(item)  # waits while the subscriber is slow: backpressure
            return
        self._to_backlog(owner, item)

    def _to_backlog(self, owner: str, item: T) -> None:
        backlog = self.backlogs.get(owner)
        if backlog is None:
            if len(self.backlogs) >= self.max_backlog_owners:
                gone, dropped = self.backlogs.popitem(last=False)
                log.warning("owner=%s backlog of %d batches dropped (too many owners without a "
                            "subscriber)", gone, len(dropped))
            backlog = self.backlogs[owner] = deque()
        if len(backlog) >= self.backlog_size:
            backlog.popleft()
            log.warning("owner=%s has no subscriber: backlog full (%d), oldest batch dropped",
                        owner, self.backlog_size)
        backlog.append(item)

    def close_all(self) -> None:
        """Draining: every stream ends after what is already queued."""
        for sub in list(self.subs.values()):
            sub.close(drop_pending=False)
        self.subs.clear()
        self._on_change(0)
