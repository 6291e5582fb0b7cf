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


async def test_replaced_subscriber_ends_and_new_one_gets_its_pending_items() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=4)
    first = subs.subscribe("o")
    await subs.publish("o", 1)
    second = subs.subscribe("o")
    assert await first.get() is None
    await subs.publish("o", 2)
    # What the first had not sent comes first: the owner's stream has no hole (issue #31).
    assert [await second.get(), await second.get()] == [1, 2]
    subs.unsubscribe(first)  # a stale stream ending does not remove the new subscriber
    assert len(subs) == 1


async def test_ended_subscription_leaves_its_pending_items_to_the_next() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=4)
    first = subs.subscribe("o")
    await subs.publish("o", 1)
    subs.unsubscribe(first)  # the stream broke before sending it
    await subs.publish("o", 2)
    second = subs.subscribe("o")
    assert [await second.get(), await second.get()] == [1, 2]


async def test_carried_items_beyond_the_queue_are_dropped_with_a_log_line(caplog) -> None:  # type: ignore[no-untyped-def]
    subs: Subscriptions[int] = Subscriptions(queue_size=2)
    for i in range(3):
        await subs.publish("o", i)
    sub = subs.subscribe("o")
    assert "owner=o 1 queued batches dropped at subscribe" in caplog.text
    assert [await sub.get(), await sub.get()] == [0, 1]


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


async def test_take_ready_takes_what_is_queued_up_to_the_limit_and_stops_at_close() -> None:
    subs: Subscriptions[int] = Subscriptions(queue_size=8)
    sub = subs.subscribe("o")
    for i in range(4):
        await subs.publish("o", i)
    assert await sub.get() == 0
    assert sub.take_ready(2) == [1, 2]
    subs.close_all()
    assert sub.take_ready(5) == [3]  # the close marker is taken, not lost:
    assert await sub.get() is None
    assert sub.take_ready(5) == []
