"""Sliding-window families through the four processes: a random Gemma 3 (local layers with window 8
around a global one) and a random Mistral (window 16 on every layer), one stack each
(`tests/random_models.py`). Six concurrent prompts of 30-80 tokens, half sharing a 70-token prefix (radix
cache hits; on the C kernels one shared dense copy of it in decode), go in 8-token prefill chunks with
decode mixed into the prefill steps, on a KV pool so small that requests are retracted and recomputed,
and come back token for token as transformers' greedy `generate`."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator

import pytest
import torch

from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_full_stack import scrape
from tests.random_models import WINDOWED, build_windowed

pytestmark = pytest.mark.e2e
NEW_TOKENS = 16
PROMPTS = 6
KV_POOL = 80 + NEW_TOKENS + 16  # the longest prompt and its output, and little more


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def family(request: pytest.FixtureRequest, model_dir: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Stack]]:
    path = str(build_windowed(request.param, tmp_path_factory.mktemp(request.param), model_dir))
    args = f"--chunked-prefill-size 8 --enable-mixed-chunk --max-total-tokens {KV_POOL}"
    with running_stack(path, "--scheduler-args", args) as stack:
        yield path, stack


def test_concurrent_chunked_retracted_greedy_matches_transformers(family: tuple[str, Stack]) -> None:
    from transformers import AutoModelForCausalLM

    path, stack = family
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(5, 4096, (70,), generator=g).tolist()
    prompts = [(shared + torch.randint(5, 4096, (3 + i,), generator=g).tolist()) if i % 2 == 0
               else torch.randint(5, 4096, (30 + 9 * i,), generator=g).tolist() for i in range(PROMPTS)]
    assert max(len(p) for p in prompts) <= 80
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: stack.generate({**body, "input_ids": ids})["output_ids"], prompts))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    assert got == want
    assert scrape(f"http://127.0.0.1:{stack.ports['sched_metrics']}/metrics")["sglang:num_retracted_reqs"] > 0
