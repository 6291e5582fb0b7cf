"""TokenizerManager in-process: the collection loop never drops output that lands while it yields."""

from __future__ import annotations

import asyncio

from ringserve.message import Finish, Load, TextDelta, TokenizedReq
from ringserve.text_tokenizer import TextTokenizer
from services.tokenizer.io_struct import GenerateInput
from services.tokenizer.routing import SchedulerView, make_router
from services.tokenizer.tokenizer_manager import ManagerSettings, TokenizerManager
from services.tokenizer.validation import Limits


class OneScheduler:
    """A scheduler link that only records what was sent."""

    def __init__(self) -> None:
        self.sent: list[TokenizedReq] = []

    def views(self, in_flight: dict[str, int]) -> list[SchedulerView]:
        return [SchedulerView("s0", True, Load())]

    async def send(self, address: str, reqs: list[TokenizedReq]) -> None:
        self.sent.extend(reqs)

    def abort(self, address: str, rids: list[str]) -> None:
        pass

    async def flush_cache(self) -> tuple[bool, str]:
        return True, ""


async def test_last_delta_arriving_during_a_yield_is_still_delivered(model_dir: str) -> None:
    sched = OneScheduler()
    manager = TokenizerManager(ManagerSettings(owner="o", limits=Limits("m")),
                               TextTokenizer.from_model(model_dir), sched, make_router("round_robin"))
    gen = manager.generate(GenerateInput(rid="r", text="hi", stream=True))
    first = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0)  # let intake run and reach the wait for output
    manager.on_deltas([TextDelta(rid="r", token_offset=0, ids=[5], text_offset=0, text="a")])
    out = await first
    assert out.output_ids == [5] and not out.finished
    # The consumer is suspended at the yield: the final delta lands now, before it asks again.
    manager.on_deltas([TextDelta(rid="r", token_offset=1, ids=[6], text_offset=1, text="b",
                                 finish=Finish(type="length"))])
    rest = [o async for o in gen]
    assert [o.output_ids for o in rest] == [[6]] and rest[-1].finished and rest[-1].text == "b"
    assert not manager.rid_to_state
