"""SchedulerOps: an operation never half-applies silently."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from ringserve.errors import AlreadyExists, InvalidArgument, ServiceError, Unavailable
from ringserve.message import LoraAdapter
from ringserve.v1 import api_pb2
from services.tokenizer.lora import LoraRegistry
from services.tokenizer.operations import SchedulerOps
from services.tokenizer.scheduler_client import SchedulerPool


def pool(*addresses: str) -> SchedulerPool:
    return SchedulerPool(list(addresses), "owner", on_rejection=lambda *a: None, on_down=lambda a: None,
                         on_change=lambda: None)


async def test_a_scheduler_that_is_down_fails_the_call_naming_it() -> None:
    p = pool("127.0.0.1:1", "127.0.0.1:2")  # never started: not connected
    ops = SchedulerOps(p)
    try:
        for call in (ops.pause("retract"), ops.resume(), ops.abort_all("x"), ops.stop_profile(),
                     ops.update_weights(api_pb2.UpdateWeightsFromDiskRequest(model_path="/m"))):
            with pytest.raises(Unavailable, match="127.0.0.1:1, 127.0.0.1:2"):
                await call
    finally:
        await p.close()


async def test_fields_are_checked_before_any_scheduler_is_asked() -> None:
    p = pool("127.0.0.1:1")
    ops = SchedulerOps(p)
    try:
        with pytest.raises(InvalidArgument, match="^mode"):
            await ops.pause("sideways")
        with pytest.raises(InvalidArgument, match="^model_path"):
            await ops.update_weights(api_pb2.UpdateWeightsFromDiskRequest())
        assert ops.paused() == ""
    finally:
        await p.close()


class FakeStub:
    """A scheduler's LoRA RPCs: `refuse` makes LoadLoraAdapter fail with that status."""

    def __init__(self, refuse: grpc.StatusCode | None = None) -> None:
        self.refuse = refuse
        self.loaded: set[str] = set()

    async def LoadLoraAdapter(self, req, timeout: float):  # noqa: N802 - the RPC's name
        if self.refuse is not None:
            raise grpc.aio.AioRpcError(self.refuse, grpc.aio.Metadata(), grpc.aio.Metadata(), "lora_path: bad files")
        self.loaded.add(req.adapter.name)

    async def UnloadLoraAdapter(self, req, timeout: float):  # noqa: N802
        if req.lora_name not in self.loaded:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        self.loaded.discard(req.lora_name)


def fake_pool(*stubs: FakeStub) -> SimpleNamespace:
    conns = {f"s{i}": SimpleNamespace(address=f"s{i}", connected=True, stub=s) for i, s in enumerate(stubs)}
    return SimpleNamespace(conns=conns)


async def test_lora_load_is_all_or_nothing_and_unload_frees_everywhere() -> None:
    good, bad = FakeStub(), FakeStub(refuse=grpc.StatusCode.INVALID_ARGUMENT)
    registry = LoraRegistry()
    ops = SchedulerOps(fake_pool(good, bad))  # type: ignore[arg-type]
    with pytest.raises(ServiceError, match="bad files"):
        await ops.load_lora(registry, LoraAdapter("x", "/x"), "base")
    assert not good.loaded and not registry.adapters  # undone where it had succeeded
    bad.refuse = None
    await ops.load_lora(registry, LoraAdapter("x", "/x"), "base")
    assert good.loaded == bad.loaded == {"x"} and list(registry.adapters) == ["x"]
    with pytest.raises(AlreadyExists):
        await ops.load_lora(registry, LoraAdapter("x", "/y"), "base")
    with pytest.raises(InvalidArgument, match="lora_name"):
        await ops.load_lora(registry, LoraAdapter("base", "/y"), "base")
    await ops.unload_lora(registry, "x")
    assert not good.loaded and not bad.loaded and not registry.adapters


async def test_a_scheduler_that_connects_syncs_its_adapters() -> None:
    old, new = FakeStub(), FakeStub()
    registry = LoraRegistry()
    registry.add(LoraAdapter("loaded-at-run-time", "/r"))
    p = fake_pool(old, new)
    ops = SchedulerOps(p)  # type: ignore[arg-type]
    ops.sync_lora(registry, p.conns["s1"], [LoraAdapter("from-its-flags", "/f")])  # type: ignore[arg-type]
    assert {a.name for a in registry.listing()} == {"loaded-at-run-time", "from-its-flags"}
    await asyncio.gather(*ops._tasks)
    assert new.loaded == {"loaded-at-run-time"}  # sent what it lacked
    assert old.loaded == {"from-its-flags"}  # and the others what it brought
