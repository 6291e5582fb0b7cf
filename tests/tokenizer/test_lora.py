"""The tokenizer's LoRA registry: picking an adapter (lora_path or model), use counts, unload waits."""

from __future__ import annotations

import asyncio

import pytest

from ringserve.errors import DeadlineExceeded, InvalidArgument, NotFound
from ringserve.message import LoraAdapter
from services.tokenizer.lora import LoraRegistry


def registry() -> LoraRegistry:
    r = LoraRegistry()
    r.add(LoraAdapter("sql", "/a/sql"))
    r.add(LoraAdapter("chat", "/a/chat"))
    return r


def test_pick() -> None:
    r = registry()
    assert r.pick("", "", "base") == "" and r.pick("", "base", "base") == ""
    assert r.pick("sql", "", "base") == "sql" and r.pick("sql", "base", "base") == "sql"
    assert r.pick("", "chat", "base") == "chat"  # vLLM: the adapter as the model
    assert r.pick("", "other", "base") == ""  # not an adapter: validation's model check answers it
    with pytest.raises(NotFound, match="'nope'.*loaded: chat, sql"):
        r.pick("nope", "", "base")
    with pytest.raises(InvalidArgument, match="model"):
        r.pick("sql", "chat", "base")


def test_route_prefix_differs_per_adapter_and_registration() -> None:
    r = registry()
    assert r.route_prefix("") == [] and r.route_prefix("sql") != r.route_prefix("chat")
    old = r.route_prefix("sql")
    r.remove("sql")
    r.add(LoraAdapter("sql", "/a/sql2"))
    assert r.route_prefix("sql") != old and all(t < 0 for t in old)


async def test_unload_waits_for_users() -> None:
    r = registry()
    r.acquire("sql", 1)
    r.acquire("sql", 1)
    r.remove("sql")
    with pytest.raises(NotFound):
        r.pick("sql", "", "base")
    with pytest.raises(DeadlineExceeded, match="2 request"):
        await r.wait_unused("sql", 0.05)
    waiter = asyncio.create_task(r.wait_unused("sql", 5))
    r.release("sql", 1)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    r.release("sql", 1)
    await asyncio.wait_for(waiter, 1)
    await r.wait_unused("chat", 0.05)  # nobody uses it: at once
