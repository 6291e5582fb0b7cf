"""Greedy parity with sliding-window attention: the engine's tokens equal transformers' `generate` token
for token on random Gemma 3 (local/global layers) and Mistral (every layer windowed) checkpoints, with
prompts of 30-110 tokens against windows of 8 and 16.

Concurrent prompts, half sharing a 70-token prefix (radix cache hits, and on the C kernels one shared
dense copy of it in decode), run plain and with a KV pool so small that requests are retracted and
recomputed (C kernels), and in 8-token prefill chunks with decode mixed into the prefill steps (C
kernels and plain torch: the padded masks).
"""

from __future__ import annotations

import pytest
import torch

from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.model_executor.sampling import SamplingParams
from tests.window_models import FAMILIES, build

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(request.param, tmp_path_factory.mktemp(request.param), model_dir))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(5, 4096, (70,), generator=g).tolist()
    out = []
    for i in range(8):
        own = torch.randint(5, 4096, (30 + 7 * i,), generator=g).tolist()
        out.append((shared + own[:10 + i]) if i % 2 == 0 else own)
    return out


@pytest.fixture(scope="module")
def reference(family_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[1, 4], pad_token_id=0)
            seq = out[0, len(ids):].tolist()
            refs.append(seq[:next((k + 1 for k, t in enumerate(seq) if t in (1, 4)), len(seq))])
    assert all(len(r) > 1 for r in refs)  # decode steps past the prompt, each with its window
    return refs


def run(model: str, prompts: list[list[int]], **cfg) -> tuple[list[list[int]], Engine]:
    engine = Engine(EngineConfig(model=model, device="cpu", **cfg))
    got = [r.output_ids for r in engine.generate(prompts, GREEDY)]
    engine.tree.check()
    return got, engine


def test_window_parity_plain_and_with_retraction(family_dir: str, prompts, reference) -> None:
    got, engine = run(family_dir, prompts, max_total_tokens=4096, max_running_requests=16)
    assert got == reference
    assert engine.tree.total_size() > 0  # the shared prefix was cached
    longest = max(len(p) for p in prompts) + MAX_NEW
    got, engine = run(family_dir, prompts, max_total_tokens=longest + 48, max_running_requests=16)
    assert got == reference
    assert engine.scheduler.stats.retractions > 0


@pytest.mark.parametrize("plain_torch", [False, True], ids=["cpu-kernels", "plain-torch"])
def test_window_parity_chunked_and_mixed(family_dir: str, prompts, reference, plain_torch: bool) -> None:
    got, engine = run(family_dir, prompts, max_total_tokens=4096, max_running_requests=16, enable_mixed_chunk=True,
                      chunked_prefill_size=8, max_prefill_tokens=24, disable_cpu_kernels=plain_torch)
    assert got == reference
    assert engine.scheduler.stats.mixed_steps > 0
