"""SchedulerOps: an operation never half-applies silently."""

from __future__ import annotations

import pytest

from ringserve.errors import InvalidArgument, Unavailable
from ringserve.v1 import api_pb2
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
