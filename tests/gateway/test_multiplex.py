"""Generations over GenerateStream (the default) and over one Generate call each: same answers."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.multiplex import Inbox
from ringserve.v1 import api_pb2 as pb
from tests.gateway.conftest import start_gateway
from tests.gateway.fake_tokenizer import MODEL, FakeTokenizer


def test_inbox_merges_what_the_consumer_has_not_taken() -> None:
    box = Inbox()
    box.add(pb.GenerateResponse(rid="r", index=0, text="a", output_ids=[1]))
    box.add(pb.GenerateResponse(rid="r", index=1, text="x", output_ids=[7]))
    box.add(pb.GenerateResponse(rid="r", index=0, text="b", output_ids=[2], finished=True,
                                meta_info=pb.MetaInfo(completion_tokens=2)))
    first, second = box.take()
    assert (first.index, first.text, list(first.output_ids), first.finished) == (0, "ab", [1, 2], True)
    assert first.meta_info.completion_tokens == 2
    assert (second.index, second.text) == (1, "x")
    assert box.take() == []


@pytest.fixture(scope="module")
def gateways(fake: FakeTokenizer) -> Iterator[dict[int, str]]:
    procs = {n: start_gateway(fake, "--tokenizer-streams", str(n)) for n in (0, 1)}
    yield {n: url for n, (_, url) in procs.items()}
    for proc, _ in procs.values():
        proc.stop()


def _ask(url: str, i: int) -> tuple[list[str], list[str]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=f"prompt {i}", max_tokens=3 + i % 5, n=1 + i % 2, seed=i)
    full = client.completions.create(**kwargs)
    streamed = [""] * len(full.choices)
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    return [c.text for c in sorted(full.choices, key=lambda c: c.index)], streamed


def test_many_concurrent_requests_on_one_stream_get_their_own_answers(gateways: dict[int, str]) -> None:
    with cf.ThreadPoolExecutor(24) as pool:
        shared = list(pool.map(lambda i: _ask(gateways[1], i), range(48)))
    separate = [_ask(gateways[0], i) for i in range(48)]
    assert shared == separate  # no output of one request leaks into another
    for full, streamed in shared:
        assert full == streamed


def test_errors_keep_their_status_on_both_paths(gateways: dict[int, str]) -> None:
    for url in gateways.values():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL,
                                      prompt="ERR INVALID_ARGUMENT sampling_params.max_new_tokens: too big")
        assert e.value.body["param"] == "max_tokens"  # type: ignore[index]  # APIError.body is typed object
        with pytest.raises(openai.APIError):
            list(client.completions.create(model=MODEL, prompt="MIDERR UNAVAILABLE gone", stream=True))
