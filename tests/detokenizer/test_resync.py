"""Resync: a full-state batch mid-stream; a client deduplicating by offset gets exactly the text."""

from __future__ import annotations

from conftest import TEXTS, split  # type: ignore[import-not-found]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.message import DecodeParams, Finish, SamplingParams, StepBatch, TextDelta, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.detokenizer import Detokenizer


class Client:
    """What the tokenizer does with TextDeltas: keep ids and text, drop what it has by offset."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""

    def apply(self, d: TextDelta) -> None:
        assert d.token_offset <= len(self.ids) and d.text_offset <= len(self.text)  # no gaps
        # Overlapping parts must agree: a resync re-sends the same ids and the same text.
        assert self.ids[d.token_offset:d.token_offset + len(d.ids)] == d.ids[:len(self.ids) - d.token_offset]
        assert self.text[d.text_offset:d.text_offset + len(d.text)] == d.text[:len(self.text) - d.text_offset]
        self.ids += d.ids[len(self.ids) - d.token_offset:]
        self.text += d.text[len(self.text) - d.text_offset:]


def feed(det: Detokenizer, client: Client, batch: StepBatch) -> None:
    batches, _ = det.step(batch)
    for b in batches:
        for d in b.deltas:
            client.apply(d)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(TEXTS), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       resync_at=st.lists(st.integers(0, 40), max_size=3), restart=st.booleans(),
       stop=st.sampled_from([(), ("fox",), ("首都",), ("🚀",)]))
def test_resync_mid_stream(tiny_tok: TextTokenizer, text: str, sizes: list[int], resync_at: list[int],
                           restart: bool, stop: tuple[str, ...]) -> None:
    ids = tiny_tok.encode(text, add_special_tokens=False)
    params = DecodeParams(owner="o", sampling=SamplingParams(stop=stop))
    det, client = Detokenizer(tiny_tok), Client()
    chunks = split(ids, sizes)
    sent = 0
    for i, chunk in enumerate(chunks):
        if i in resync_at:
            if restart:  # a new detokenizer process: no state at all
                det = Detokenizer(tiny_tok)
            feed(det, client, StepBatch([TokenDelta("r", ids[:sent], 0, params)], resync=True))
        last = i == len(chunks) - 1
        feed(det, client, StepBatch([TokenDelta("r", chunk, sent, params if i == 0 else None,
                                                Finish("length") if last else None)]))
        sent += len(chunk)
    assert client.ids == ids
    assert client.text == tiny_tok.decode(ids)
    assert len(det) == 0


def test_resync_without_state_and_unknown_rid(tiny_tok: TextTokenizer) -> None:
    det = Detokenizer(tiny_tok)
    batches, stats = det.step(StepBatch([TokenDelta("ghost", [5, 6], 3)]))  # unknown rid, no params
    assert batches == [] and stats.deltas_dropped == 1
    ids = tiny_tok.encode("hello there", add_special_tokens=False)
    client = Client()
    feed(det, client, StepBatch([TokenDelta("r", ids, 0, DecodeParams("o"))], resync=True))
    feed(det, client, StepBatch([TokenDelta("r", [], len(ids), None, Finish("abort", message="gone"))]))
    assert client.text == "hello there" and len(det) == 0  # aborted: state freed


def test_state_cap(tiny_tok: TextTokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    det = Detokenizer(tiny_tok, max_tracked_requests=2)
    batch = StepBatch([TokenDelta(f"r{i}", [70], 0, DecodeParams("o")) for i in range(3)])
    batches, stats = det.step(batch)
    assert len(det) == 2 and stats.deltas_dropped == 1
    assert "max tracked requests (2)" in caplog.text and "rid=r2" in caplog.text
    det.step(StepBatch([TokenDelta("r0", [], 1, None, Finish("length"))]))
    det.step(StepBatch([TokenDelta("r2", [70], 0, DecodeParams("o"))]))
    assert set(det.states) == {"r1", "r2"}


def test_routing_by_owner_one_batch_per_step(tiny_tok: TextTokenizer) -> None:
    det = Detokenizer(tiny_tok)
    batch = StepBatch([TokenDelta(f"r{i}", [70, 71], 0, DecodeParams(f"o{i % 2}")) for i in range(6)],
                      sent_at=12.5)
    batches, stats = det.step(batch)
    assert sorted(b.owner for b in batches) == ["o0", "o1"]
    for b in batches:
        assert b.step_sent_at == 12.5
        assert {d.rid for d in b.deltas} == {f"r{i}" for i in range(6) if f"o{i % 2}" == b.owner}
    assert stats.tokens == 12
