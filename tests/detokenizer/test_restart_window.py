"""The restart resync window (issue #31): a detokenizer restarted at any token position, the
tokenizer's subscription replaced once before it read anything, and the text stays exact.

In-process and deterministic: the real detokenizer core and its Subscriptions, and the tokenizer's
ReqState, wired as the processes are; the scheduler's part is the batches it sends. At each token
position k of a real tokenizer's CJK/emoji output:

  1. the old detokenizer streamed ids[:k] one per step; the tokenizer has all of it;
  2. it dies; the scheduler generates LOST more ids, their batches dropped (push stream down);
  3. the new detokenizer gets the scheduler's resync (all ids so far) before any tokenizer is
     subscribed: its text goes to the owner's backlog;
  4. the tokenizer subscribes, and subscribes again before reading (a handshake that timed out):
     the first subscription, holding the backlog, is replaced;
  5. one more step's delta arrives (text_offset counted from the resync, past what the tokenizer has);
  6. the resync the second subscription asked for arrives, then the rest of the output.

Before the fix the step-5 delta was spliced on at the tokenizer's end (the backlog it continued
was dropped with the replaced subscription): the text lost a piece and the ids a token, in every
stream of the step, and the resync could not repair it (both dedups count what they hold).
"""

from __future__ import annotations

import asyncio

import pytest

from ringserve.message import DecodeParams, Finish, SamplingParams, StepBatch, TokenDelta, TokenizedReq
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.detokenizer import Detokenizer, OwnerBatch
from services.detokenizer.subscriptions import Subscription, Subscriptions
from services.tokenizer.request_state import ReqState

OWNER = "tok-a"
LOST = 3  # ids generated while no detokenizer was up
TEXTS = [
    "東京は首都です。机器学习 😀🚀 👍🏽 한국어",
]


@pytest.fixture(scope="module")
def smol(real_model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(real_model_dir)


class Node:
    """One detokenizer process: the core and the per-owner routing."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.core = Detokenizer(tok)
        self.subs: Subscriptions[OwnerBatch] = Subscriptions(queue_size=256)

    async def push(self, deltas: list[TokenDelta], resync: bool = False) -> None:
        batches, _ = self.core.step(StepBatch(deltas, resync=resync))
        for b in batches:
            await self.subs.publish(b.owner, b)


def drain(sub: Subscription[OwnerBatch], state: ReqState) -> None:
    """The tokenizer reading its subscription: every queued TextDelta into the request's state."""
    while not sub.queue.empty():
        item = sub.queue.get_nowait()
        if isinstance(item, OwnerBatch):
            for d in item.deltas:
                state.apply(d)


def new_state() -> ReqState:
    req = TokenizedReq(rid="r", owner=OWNER, input_ids=[1], sampling=SamplingParams(), stream=True)
    return ReqState(req=req, group="r", index=0, scheduler="s", event=asyncio.Event())


async def run_window(tok: TextTokenizer, ids: list[int], k: int) -> tuple[list[int], str]:
    params = DecodeParams(owner=OWNER, sampling=SamplingParams(), stream=True)
    state = new_state()
    got_ids: list[int] = []
    got_text = ""

    def take() -> None:
        nonlocal got_text
        chunk = state.take()
        got_ids.extend(chunk.ids)
        got_text += chunk.text

    def fin(n: int) -> Finish | None:
        return Finish("length") if n == len(ids) else None

    def step(i: int) -> TokenDelta:
        return TokenDelta("r", [ids[i]], i, params if i == 0 else None, fin(i + 1))

    def resync(n: int) -> TokenDelta:  # the scheduler's full state: a finished request with its finish
        return TokenDelta("r", ids[:n], 0, params, fin(n))

    old = Node(tok)
    sub = old.subs.subscribe(OWNER)
    for i in range(k):  # 1. the old detokenizer streams ids[:k]
        await old.push([step(i)])
        drain(sub, state)
        take()
    sent = min(len(ids) - 1, k + LOST)  # 2. ids[k:sent] are generated while it is down (dropped)
    new = Node(tok)
    await new.push([resync(sent)], resync=True)  # 3. into the backlog
    new.subs.subscribe(OWNER)  # 4. subscribed, then replaced before it was read
    sub = new.subs.subscribe(OWNER)
    await new.push([step(sent)])  # 5. a step before the resync that subscription asked for
    drain(sub, state)
    take()
    await new.push([resync(sent + 1)], resync=True)  # 6. the resync
    drain(sub, state)
    take()
    for i in range(sent + 1, len(ids)):
        await new.push([step(i)])
        drain(sub, state)
        take()
    assert state.finished, f"k={k}: never finished"
    return got_ids, got_text


@pytest.mark.parametrize("text", TEXTS)
async def test_restart_at_every_position_keeps_text_exact(smol: TextTokenizer, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    want = smol.decode(ids)
    for k in range(len(ids)):
        got_ids, got_text = await run_window(smol, ids, k)
        assert got_ids == ids, f"restart after {k} ids: ids differ"
        assert got_text == want, f"restart after {k} ids: {got_text!r} != {want!r}"
        assert "\ufffd" not in got_text
