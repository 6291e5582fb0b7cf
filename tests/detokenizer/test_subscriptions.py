"""Per-owner bounded queues: backpressure, replacement, bounded backlog."""

from __future__ import annotations

import asyncio

from services.detokenizer.subscriptions import Subscriptions


async def test_full_queue_backpressures_publish() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=2)
    sub = subs.subscribe("o")
    await subs.publish("o", 1)
    await subs.publish("o", 2)
    blocked = asyncio.create_task(subs.publish("o", 3))
    await asyncio.sleep(0)  # let it run up to the full queue (a scheduling point, not a readiness wait)
    assert not blocked.done()
    assert await sub.get() == 1
    await asyncio.wait_for(blocked, 1)
    assert [await sub.get(), await sub.get()] == [2, 3]


async def test_replaced_subscriber_ends_and_new_one_gets_items() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=4)
    first = subs.subscribe("o")
    await subs.publish("o", 1)
    second = subs.subscribe("o")
    assert await first.get() is None  # pending items dropped: the resync re-sends them
    await subs.publish("o", 2)
    assert await second.get() == 2
    subs.unsubscribe(first)  # a stale stream ending does not remove the new subscriber
    assert len(subs) == 1


async def test_backlog_is_bounded_and_logged(caplog) -> None:  # type: ignore[no-untyped-def]
    subs: Subscriptions[int] = Subscriptions(queue_size=8, backlog_size=3, max_backlog_owners=2)
    for i in range(5):
        await subs.publish("late", i)
    assert "owner=late has no subscriber: backlog full (3)" in caplog.text
    await subs.publish("x", 0)
    await subs.publish("y", 0)  # a third owner evicts the oldest backlog
    assert "owner=late backlog of 3 batches dropped" in caplog.text
    sub = subs.subscribe("x")
    assert await sub.get() == 0


async def test_close_all_ends_streams_after_queued_items() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=2)
    sub = subs.subscribe("o")
    await subs.publish("o", 1)
    subs.close_all()
    assert await sub.get() == 1 and await sub.get() is None
